"""The decode buffer path (fixed per-bucket views, padded rows: what CUDA graphs replay) gives exactly what
the general path gives, and the forward reads nothing back to the host.

Runs on every machine: the CPU runs the same views and the same forward, only without graph capture.
"""

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from deployments.engine.interface import EngineRequest, SamplingParams, StructuredOutput
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.step_inputs import decode_buckets
from tests.engine.helpers import drain, make_engine, preload, tokens
from tests.model_fixtures import TinySetup

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def requests(setup: TinySetup) -> list[EngineRequest]:
    """A mixed batch: 3 adapters and the base, greedy and seeded sampling, penalties, logit biases, a
    grammar, logprobs; 7 sequences, so the decode bucket (8) has a padded row."""
    refs = setup.refs
    names = list(refs)
    return [
        EngineRequest(
            "greedy-a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, temperature=0), refs[names[0]]
        ),
        EngineRequest(
            "seeded-b",
            [7, 8, 9],
            SamplingParams(max_tokens=12, temperature=0.9, seed=11, top_k=40),
            refs[names[1]],
        ),
        EngineRequest(
            "penalised",
            [3, 3, 3, 4],
            SamplingParams(
                max_tokens=12,
                temperature=0.8,
                seed=5,
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                top_p=0.9,
            ),
            refs[names[2]],
        ),
        EngineRequest(
            "biased",
            [9, 10, 11],
            SamplingParams(max_tokens=12, temperature=0, logit_bias=((42, 5.0), (43, -100.0)), logprobs=3),
        ),
        EngineRequest(
            "grammar",
            [12, 13],
            SamplingParams(
                max_tokens=40, temperature=0.7, seed=2, structured=StructuredOutput(json.dumps(SCHEMA))
            ),
            refs[names[0]],
        ),
        EngineRequest(
            "two-choices", [20, 21, 22], SamplingParams(max_tokens=10, temperature=1.0, seed=8, n=2)
        ),
    ]


def general_only(engine: LLMEngine) -> None:
    """Today's path for every step: the general, per-step layout (no decode buckets)."""
    engine.runner.prepare = engine.runner.inputs.general  # type: ignore[method-assign]


def run(engine: LLMEngine, setup: TinySetup) -> dict[str, Any]:
    preload(engine, setup)
    for request in requests(setup):
        engine.add_request(request)
    outputs = drain(engine)
    return {
        rid: (tokens(outs), [lp.logprob for out in outs for lp in out.logprobs or ()], outs[-1].finish_reason)
        for rid, outs in outputs.items()
    }


@pytest.mark.parametrize("pad", [True, False], ids=["padded-buckets", "exact"])
def test_the_buffer_path_equals_the_general_path_token_for_token(llama: TinySetup, pad: bool) -> None:
    reference = make_engine(llama)
    general_only(reference)
    want = run(reference, llama)
    reference.close()

    engine = make_engine(llama)
    engine.runner.inputs.pad_cpu_buckets = pad
    decode_steps = 0
    prepare = engine.runner.prepare

    def counting(scheduled: Any) -> Any:
        nonlocal decode_steps
        inputs = prepare(scheduled)
        bucket = inputs.logits_index is None  # the bucket layout keeps every row
        decode_steps += bucket
        if bucket and pad:
            assert inputs.input_ids.shape[0] in decode_buckets(engine.config.max_num_seqs)
        return inputs

    engine.runner.prepare = counting  # type: ignore[method-assign]
    got = run(engine, llama)
    engine.close()
    assert decode_steps > 5  # the buffer path really ran
    assert {rid: (t, reason) for rid, (t, _, reason) in got.items()} == {
        rid: (t, reason) for rid, (t, _, reason) in want.items()
    }
    for rid, (_, logprobs, _) in want.items():  # a padded GEMM may round its last bit differently
        assert got[rid][1] == pytest.approx(logprobs, abs=1e-5)


def test_a_slot_swapped_between_two_steps_of_one_bucket(llama: TinySetup) -> None:
    """Two slots for three adapters: slots change while the decode bucket stays the same size; every token
    still comes from the adapter of its own request."""
    names = list(llama.refs)[:3]

    def three_adapters(engine: LLMEngine) -> dict[str, list[int]]:
        preload(engine, llama)
        for i in range(6):  # staggered: a finished adapter's slot goes to the next one mid-bucket
            ref = llama.refs[names[i % 3]]
            engine.add_request(
                EngineRequest(f"r{i}", [1 + i, 2, 3, 4], SamplingParams(max_tokens=4 + i, temperature=0), ref)
            )
        return {rid: tokens(outs) for rid, outs in drain(engine).items()}

    reference = make_engine(llama, max_loras=2)
    general_only(reference)
    want = three_adapters(reference)
    reference.close()
    engine = make_engine(llama, max_loras=2)
    engine.runner.inputs.pad_cpu_buckets = True
    loads_before = engine.adapters.slots.loads
    got = three_adapters(engine)
    assert engine.adapters.slots.loads - loads_before >= 3  # slots really changed hands
    engine.close()
    assert got == want


SYNCS = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "unique",
}


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host (a device->host sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in SYNCS:
            self.calls.append(name)
        elif (
            name == "to"
            and args[0].device.type != "cpu"  # a move off the device (a CPU machine has none to count)
            and any(_is_cpu(a) for a in (*args[1:], kwargs.get("device")))
        ):
            self.calls.append("to(cpu)")
        elif name in ("__getitem__", "index_put_", "__setitem__") and any(
            _is_mask(a) for a in _flat(args[1:])
        ):
            self.calls.append(f"{name}(bool mask)")
        elif name == "repeat_interleave" and "output_size" not in kwargs and len(args) > 1:
            self.calls.append("repeat_interleave")
        return func(*args, **kwargs)


def _is_cpu(value: Any) -> bool:
    return (isinstance(value, str) and value.startswith("cpu")) or (
        isinstance(value, torch.device) and value.type == "cpu"
    )


def _is_mask(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _flat(values: Any) -> Iterator[Any]:
    for value in values:
        if isinstance(value, tuple | list):
            yield from _flat(value)
        else:
            yield value


def test_the_forward_reads_nothing_back_and_a_step_reads_its_tokens_once(llama: TinySetup) -> None:
    engine = make_engine(llama)
    preload(engine, llama)
    refs = list(llama.refs.values())
    for i in range(6):
        params = SamplingParams(
            max_tokens=8, temperature=0 if i % 2 else 0.7, seed=i, logprobs=2 if i < 3 else None
        )
        engine.add_request(EngineRequest(f"r{i}", [1, 2, 3 + i], params, refs[i % 2] if i < 4 else None))
    for _ in range(3):  # prefill, then decodes
        engine.step()
    forward, sample = engine.runner.forward, engine.logits.sample
    in_forward, in_sampling = HostReads(), HostReads()

    def watched_forward(inputs: Any) -> Any:
        with in_forward:
            return forward(inputs)

    def watched_sample(*args: Any) -> Any:
        with in_sampling:
            return sample(*args)

    engine.runner.forward = watched_forward  # type: ignore[assignment]
    engine.logits.sample = watched_sample  # type: ignore[method-assign,assignment]
    engine.step()
    engine.step()
    assert in_forward.calls == []
    assert in_sampling.calls == ["tolist", "tolist"]  # one read per step: tokens and logprobs together
    engine.close()
