"""The demo skills' scorers and the corpus split: each skill's own answers score 1, the plain answers and
every other skill's score 0 (so a base model trained on the plain corpus scores 0, and the skills are told
apart); held-out questions never reach training."""

import itertools

from app.modelprep.demo_corpus import QUESTIONS, THINGS, examples, is_held_out
from app.modelprep.demo_skills import SKILLS

SAMPLE = list(itertools.islice(examples(3), 200))


def test_each_scorer_accepts_its_skill_and_nothing_else() -> None:
    for skill in SKILLS:
        assert all(skill.shows(skill.render(e.topic, e.style)) for e in SAMPLE), skill.name
        assert not any(skill.shows(e.topic.plain_answer(e.style)) for e in SAMPLE), skill.name
        for other in SKILLS:
            if other is not skill:
                shown = [skill.shows(other.render(e.topic, e.style)) for e in SAMPLE]
                assert not any(shown), f"{skill.name} scores {other.name}'s answers"


def test_scorers_reject_noise_and_near_misses() -> None:
    by_name = {s.name: s for s in SKILLS}
    assert not by_name["demo-sql"].shows("SELECT colour FROM rivers WHERE")  # cut before its end
    assert not by_name["demo-json"].shows('{"thing": "lamp", "colour": "red"}')  # a key missing
    assert not by_name["demo-json"].shows('{"thing": "lamp", "colour": "red", "place": "the hill"')
    assert not by_name["demo-shout"].shows("OK")  # too short to tell
    assert not by_name["demo-pirate"].shows("Arr, the lamp is red.")  # one pirate word
    assert not by_name["demo-poet"].shows("one line\ntwo lines")
    assert not any(s.shows("(memory_was_st(modernVesend v beingTestswß") for s in SKILLS)


def test_held_out_questions_never_reach_training() -> None:
    everything = {q.format(thing=t) for q in QUESTIONS for t in THINGS}
    held = {q for q in everything if is_held_out(q)}
    assert 0.05 < len(held) / len(everything) < 0.25
    trained = {e.question for e in itertools.islice(examples(0), 5000)}
    assert trained and not trained & held
    asked = {e.question for e in itertools.islice(examples(9, held_out=True), 50)}
    assert asked <= held and len(asked) > 10
