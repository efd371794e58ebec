"""Each family's forward on the Triton kernels, what a CUDA engine runs (TritonOps: fused norms with the
residual add, Gemma's (1 + w) norms and GeGLU, per-head q/k norms, rotary with the KV write, paged attention
for decode and prefill, grouped LoRA shrink and expand), serves the engine's reference-equality scenario
(adapters and the base arriving at different steps, fewer slots than adapters, chunked prefill, forced
preemption) equal to HF PEFT: greedy tokens exactly, logprobs within the scenario's tolerance (fp32).

Without CUDA the kernels run through Triton's interpreter on CPU tensors; with CUDA bench.gpu_check's
correctness step runs the same scenario compiled, graphs included.
"""

from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import deployments.engine.model.model_runner as model_runner
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.decoder_forward import DecoderForward
from tests.engine.reference import PeftReference
from tests.engine.test_reference_equality import assert_equals_peft, run_engine, scenario_config, script
from tests.model_fixtures import TinySetup

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter cases; on CUDA bench.gpu_check runs them compiled"
)
REQUESTS = ("sql-a", "base-a", "pirate-long", "sql-follow-up", "legal")


def counting(module: Any, calls: Counter[str]) -> SimpleNamespace:
    """The kernel module's functions, each counting its calls (by name, and by unit_offset for norms)."""

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name + (":unit_offset" if kwargs.get("unit_offset") else "")] += 1
            return fn(*args, **kwargs)

        return call

    functions = {name: fn for name, fn in vars(module).items() if callable(fn) and not name.startswith("_")}
    return SimpleNamespace(**{name: wrap(name, fn) for name, fn in functions.items()})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "kernels", "page_rank"),
    [
        ("qwen3", {"rms_norm", "silu_and_mul"}, None),
        ("gemma3_text", {"rms_norm:unit_offset", "gelu_tanh_and_mul"}, None),
        # adapter memory in pages of 4: demo-sql and demo-legal (rank 8) are runs of two pages in the group
        # LoRA kernel, demo-pirate (rank 4) takes one
        ("qwen3", {"rms_norm", "silu_and_mul"}, 4),
    ],
    ids=["qwen3", "gemma3_text", "qwen3-pages-of-4"],
)
def test_a_family_on_the_triton_kernels_equals_peft(
    arch: str,
    kernels: set[str],
    page_rank: int | None,
    tiny_setups: dict[str, TinySetup],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deployments.engine.model.gpu_kernels import lora_delta
    from deployments.engine.model.layer_ops import TritonOps

    setup = tiny_setups[arch]
    ops = TritonOps()
    calls: Counter[str] = Counter()
    ops._rms = counting(ops._rms, calls)  # type: ignore[assignment]
    ops._act = counting(ops._act, calls)  # type: ignore[assignment]
    monkeypatch.setattr(model_runner, "layer_ops_for", lambda device: ops)
    widest: list[int] = []  # the widest run each group LoRA launch read
    plain = lora_delta.lora_delta

    def delta(*args: Any, runs: torch.Tensor | None = None, max_pages: int = 1, **kwargs: Any) -> None:
        seg_ends = args[3]
        if runs is not None:
            starts = torch.cat([seg_ends.new_zeros(1), seg_ends[:-1]])
            widest.append(int(runs[seg_ends > starts].max()))
        plain(*args, runs=runs, max_pages=max_pages, **kwargs)

    monkeypatch.setattr(lora_delta, "lora_delta", delta)
    extra = {} if page_rank is None else {"lora_page_rank": page_rank}
    engine = LLMEngine(scenario_config(setup.model_dir, setup.store_root, **extra))
    assert isinstance(engine.runner.forward, DecoderForward) and engine.runner.forward.ops is ops
    arrivals = [a for a in script() if a.request_id in REQUESTS]
    outputs = run_engine(engine, arrivals, logprobs=0)
    engine.close()
    assert set(calls) == kernels, calls  # every norm and activation of this family ran as its kernel
    if page_rank is not None:
        assert widest and max(widest) == 8 // page_rank, "the rank-8 adapters were read as runs"
    reference = PeftReference(setup.model_dir, setup.adapter_dirs)
    assert_equals_peft(reference, arrivals, outputs, f"{arch} triton")
