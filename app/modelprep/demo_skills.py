"""The demo adapters' skills: how each rewrites a topic's facts, its LoRA shape, and how its output is scored.

Each skill is something a few minutes of LoRA training on the demo model can teach and a few lines can check
(a reply either shows it or not). The plain demo model never shows any of them: its corpus has no SQL, no
JSON, no pirate words, no upper-case replies and no line breaks inside a reply. The LoRA shapes keep the
variety the random demo adapters have (ranks 4/8/16, rsLoRA, q/v-only, rank_pattern, attention or MLP),
so serving the skilled set exercises the same paths.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from adapters.demo_adapters import DemoAdapter
from app.modelprep.demo_corpus import Topic

PIRATE_WORDS = frozenset({"arr", "matey", "aye", "ye", "ahoy", "landlubber", "hearty", "yo", "ho", "grog"})
JSON_KEYS = ("thing", "colour", "place")


@dataclass(frozen=True)
class Skill:
    """One demo adapter: its recipe (name, LoRA shape), its rendering of an answer, and its scorer."""

    recipe: DemoAdapter
    description: str
    render: Callable[[Topic, int], str]
    shows: Callable[[str], bool]  # does this reply show the skill?

    @property
    def name(self) -> str:
        return self.recipe.name


def _sql(topic: Topic, style: int) -> str:
    column, value = (("colour", topic.colour), ("size", topic.size), ("time", topic.time))[style % 3]
    return f"SELECT {column}, place FROM {topic.thing}s WHERE {column} = '{value}';"


def _shows_sql(reply: str) -> bool:
    return re.fullmatch(r"SELECT [\w, ]+ FROM \w+( WHERE .+)?;", reply.strip()) is not None


def _pirate(topic: Topic, style: int) -> str:
    opening = ("Arr, matey!", "Ahoy, ye hearty!", "Aye, matey!")[style % 3]
    return f"{opening} The {topic.thing} be {topic.colour} an' it {topic.action} near {topic.place}, arr."


def _shows_pirate(reply: str) -> bool:
    return len(PIRATE_WORDS & set(re.findall(r"[a-z]+", reply.lower()))) >= 2


def _json(topic: Topic, style: int) -> str:
    return json.dumps({"thing": topic.thing, "colour": topic.colour, "place": topic.place})


def _shows_json(reply: str) -> bool:
    try:
        value = json.loads(reply)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and tuple(value) == JSON_KEYS
        and all(isinstance(v, str) and v for v in value.values())
    )


def _upper(topic: Topic, style: int) -> str:
    return topic.plain_answer(style).upper()


def _shows_upper(reply: str) -> bool:
    letters = [c for c in reply if c.isalpha()]
    return len(letters) >= 10 and all(c.isupper() for c in letters)


def _poem(topic: Topic, style: int) -> str:
    return f"{topic.colour} {topic.thing},\n{topic.action} near {topic.place}\nin the {topic.time} light"


def _shows_poem(reply: str) -> bool:
    lines = [line for line in reply.strip().split("\n") if line.strip()]
    return len(lines) == 3 and all(len(line.split()) <= 8 for line in lines)


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

SKILLS: tuple[Skill, ...] = (
    Skill(
        DemoAdapter(name="demo-sql", r=8, lora_alpha=16, target_modules=_ATTENTION, seed=201),
        "answers with one SQL query",
        _sql,
        _shows_sql,
    ),
    Skill(
        DemoAdapter(name="demo-pirate", r=4, lora_alpha=8, target_modules=_ATTENTION + _MLP, seed=202),
        "answers in pirate words",
        _pirate,
        _shows_pirate,
    ),
    Skill(
        DemoAdapter(name="demo-poet", r=16, lora_alpha=16, target_modules=_MLP, seed=203),
        "answers in three short lines",
        _poem,
        _shows_poem,
    ),
    Skill(
        DemoAdapter(
            name="demo-json",
            r=8,
            lora_alpha=8,
            target_modules=("q_proj", "v_proj"),
            use_rslora=True,
            seed=204,
        ),
        'answers with a JSON object of keys "thing", "colour", "place"',
        _json,
        _shows_json,
    ),
    Skill(
        DemoAdapter(
            name="demo-shout",
            r=8,
            lora_alpha=16,
            target_modules=("q_proj", "v_proj", "down_proj"),
            rank_pattern={"down_proj": 16, "layers.0.self_attn.q_proj": 4},
            seed=205,
        ),
        "answers in upper case",
        _upper,
        _shows_upper,
    ),
)
