"""The demo's training text, generated from a small grammar with a seed: chat turns about everyday things.

A "topic" is a thing with a few facts (a kind, a colour, a place, an action, a time). A user turn asks about
it in one of a few phrasings; the plain assistant turn answers in one or two sentences built from the facts.
The demo base model learns these (so it speaks in this style and ends its turns); each demo skill
(app/modelprep/demo_skills.py) rewrites the same facts its own way, which its adapter learns.
Nothing is downloaded: the word lists below are the whole vocabulary.
"""

import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


THINGS = _words(
    """
river garden engine lamp bridge forest market harbor castle kitchen library tower village mountain
island meadow orchard bakery station workshop museum temple valley canyon desert lake farm school
theater factory ship wagon bicycle clock mirror piano violin candle compass lantern kettle blanket
basket ladder window door table chair carpet fountain statue well mill barn cabin tent road path
"""
)
COLOURS = _words("red blue green white black golden silver brown grey yellow purple orange")
SIZES = _words("small large tall narrow wide old new quiet busy bright")
PLACES = (
    "the hill", "the sea", "the town", "the square", "the old wall", "the north gate", "the river bank",
    "the forest edge", "the market street", "the station", "the park", "the valley floor",
)  # fmt: skip
ACTIONS = _words("shines turns opens waits rests stands sings glows moves shakes sleeps hums grows listens")
TIMES = _words("morning evening night noon winter summer spring autumn")
PEOPLE = _words("people children travellers farmers sailors students workers neighbours")
VERBS = _words("visit watch clean paint repair admire guard share")

QUESTIONS = (
    "What is the {thing}?",
    "Tell me about the {thing}.",
    "Where is the {thing}?",
    "Can you describe the {thing}?",
    "What do you know about the {thing}?",
    "Say something about the {thing}.",
    "Why do people like the {thing}?",
    "How does the {thing} look?",
)
SYSTEMS = ("You are a helpful assistant.", "You answer briefly.", "You are a friendly guide.")


@dataclass(frozen=True)
class Topic:
    """One thing and its facts; every rendering of an answer (plain or skilled) uses only these."""

    thing: str
    colour: str
    size: str
    place: str
    action: str
    time: str
    people: str
    verb: str

    def plain_answer(self, style: int) -> str:
        """The base model's answer: one or two sentences in the corpus's style."""
        first = (
            f"The {self.thing} is {self.size} and {self.colour}, and it {self.action} near {self.place}.",
            f"The {self.size} {self.thing} stands near {self.place} and {self.action} in the {self.time}.",
            f"Near {self.place} there is a {self.colour} {self.thing} that {self.action} every {self.time}.",
        )[style % 3]
        second = (
            f" Many {self.people} {self.verb} it in the {self.time}.",
            f" The {self.people} like to {self.verb} it.",
            "",
        )[(style // 3) % 3]
        return first + second


def random_topic(rng: random.Random) -> Topic:
    return Topic(
        thing=rng.choice(THINGS),
        colour=rng.choice(COLOURS),
        size=rng.choice(SIZES),
        place=rng.choice(PLACES),
        action=rng.choice(ACTIONS),
        time=rng.choice(TIMES),
        people=rng.choice(PEOPLE),
        verb=rng.choice(VERBS),
    )


@dataclass(frozen=True)
class Example:
    """One chat exchange: an optional system message, the user's question, and its topic's facts."""

    system: str | None
    question: str
    topic: Topic
    style: int

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": self.question}]


def examples(seed: int, *, held_out: bool = False) -> Iterator[Example]:
    """An endless, deterministic stream of exchanges; each seed gives its own stream.

    About one question in eight (by a hash of its text) is held out: training never sees it, so an
    evaluation on `held_out=True` asks only questions no model or adapter was trained on."""
    rng = random.Random(seed)
    while True:
        topic = random_topic(rng)
        system = rng.choice(SYSTEMS) if rng.random() < 0.3 else None
        question = rng.choice(QUESTIONS).format(thing=topic.thing)
        style = rng.randrange(9)
        if is_held_out(question) == held_out:
            yield Example(system, question, topic, style)


def is_held_out(question: str) -> bool:
    return zlib.crc32(question.encode()) % 8 == 0
