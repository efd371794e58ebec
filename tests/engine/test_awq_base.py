"""Our AWQ int4 linear (deployments/engine/model/awq_base.py) and its loader against the CPU AWQ path
(transformers + gptqmodel's TorchAtenAwqLinear) on the same checkpoint.

Without CUDA our Triton kernels run through Triton's interpreter on CPU tensors (tests/triton_interpreter.py);
everything here skips where Triton or gptqmodel is not installed. Tolerances:
- against the exact fp32 dense weight (app/modelprep's reference dequantizer, the weights of the dense model
  test_quantized.py compares with): fp32 sums in another order, within 1e-5 relative to the output's largest
  value; against gptqmodel's dequantizing mode, whose weight is rounded to the fp16 scales' precision, 1e-3;
- against gptqmodel's fused CPU int4 kernel (what the CPU engine serves; it rounds activations and scales to
  bf16 inside): within 1e-2 relative, bf16's precision;
- the engine, adapters included: greedy tokens equal to the fp32 model with the checkpoint's dequantized
  weights (both fp32); against the gptqmodel engine (bf16 inside its kernel) equal up to the first near-tie,
  where our pick is within BF16_LOGPROB_TOL of its best (seen: one such flip in 24 tokens).
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from app.modelprep.awq_export import (
    dequantize_gemm,
    export_awq,
    load_dequantized_state_dict,
    quantize_linear_weight,
)
from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest
from deployments.engine.model.awq_base import AwqLinear, dequantize_in_torch
from deployments.engine.model.model_loader import _awq_ours
from deployments.engine.outputs import TokenLogprob
from deployments.engine.sampling_params import SamplingParams
from tests.engine.helpers import drain, make_engine, preload
from tests.engine.reference import PeftReference
from tests.model_fixtures import TinySetup

pytest.importorskip("gptqmodel")
triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter cases; on CUDA bench.gpu_check's awq step runs them"
)
EXACT_REL_TOL = 1e-5
BF16_LOGPROB_TOL = 0.05
STEPS = 8
FP16_WEIGHT_REL_TOL = 1e-3
BF16_REL_TOL = 1e-2
K, N, GROUP = 64, 96, 32


def gen_randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@dataclass(frozen=True)
class Packed:
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor


@pytest.fixture(scope="module")
def packed() -> Packed:
    tensors = quantize_linear_weight(gen_randn(N, K, seed=31), GROUP)
    return Packed(tensors.qweight, tensors.qzeros, tensors.scales, gen_randn(N, seed=32))


def gptqmodel_layer(p: Packed, mode: str | None) -> nn.Module:
    from gptqmodel.nn_modules.qlinear.torch_aten_kernel_awq import TorchAtenAwqLinear

    module = TorchAtenAwqLinear(
        bits=4, group_size=GROUP, sym=False, desc_act=False, in_features=K, out_features=N, bias=True
    )
    for name in ("qweight", "qzeros", "scales"):
        getattr(module, name).copy_(getattr(p, name))
    module.bias.copy_(p.bias)
    module.post_init()
    module.linear_mode = mode  # "train": dequantize + matmul; None: its fused int4 kernel (the served path)
    layer: nn.Module = module.eval()
    return layer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("rows", [5, 40], ids=["fused-gemm", "dequantize-matmul"])
def test_awq_linear_equals_gptqmodels_cpu_layer(packed: Packed, rows: int) -> None:
    ours = AwqLinear(
        packed.qweight, packed.qzeros, packed.scales.float(), group_size=GROUP, bias=packed.bias,
        fused_max_rows=16,
    )  # fmt: skip
    assert ours.uses_triton  # the interpreter: this is the kernels' path, not the torch fallback
    x = gen_randn(2, rows // 2 + rows % 2, K, seed=33)[:, : rows // 2 + rows % 2]
    with torch.no_grad():
        got = ours(x)
        exact = x @ dequantize_gemm(packed.qweight, packed.qzeros, packed.scales, GROUP).t() + packed.bias
        dense_fp16 = gptqmodel_layer(packed, "train")(x)
        served = gptqmodel_layer(packed, None)(x)
    assert got.shape == (*x.shape[:-1], N) and got.dtype == x.dtype
    assert rel(got, exact) < EXACT_REL_TOL
    assert rel(got, dense_fp16) < FP16_WEIGHT_REL_TOL
    assert rel(got, served) < BF16_REL_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_torch_fallback_is_the_kernels_weight(packed: Packed, dtype: torch.dtype) -> None:
    from deployments.engine.model.gpu_kernels.awq_dequant import awq_dequantize

    scales = packed.scales.to(dtype)
    want = awq_dequantize(packed.qweight, packed.qzeros, scales, GROUP)
    got = dequantize_in_torch(packed.qweight, packed.qzeros, scales, GROUP)
    if dtype == torch.bfloat16:  # the interpreter's fp32 -> bf16 cast truncates where torch rounds
        assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7
    else:
        assert torch.equal(got, want)


def test_awq_linear_refuses_tensors_that_do_not_fit(packed: Packed) -> None:
    with pytest.raises(ValueError, match="group_size"):
        AwqLinear(packed.qweight, packed.qzeros, packed.scales, group_size=48)
    with pytest.raises(ValueError, match="do not match"):
        AwqLinear(packed.qweight, packed.qzeros[:1], packed.scales, group_size=GROUP)


def test_the_cpu_keeps_gptqmodel_unless_told(llama: TinySetup) -> None:
    def config(kernel: str) -> EngineConfig:
        return EngineConfig(model=llama.model_dir, adapter_store=llama.store_root, awq_kernel=kernel)

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not _awq_ours(config("auto"), cpu)  # gptqmodel is installed here
    assert _awq_ours(config("auto"), cuda)
    assert _awq_ours(config("ours"), cpu)
    assert not _awq_ours(config("gptqmodel"), cuda)


def test_engine_greedy_through_our_awq_linear_matches_the_dense_model_and_the_gptqmodel_path(
    llama: TinySetup, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A mixed batch (two adapters and the base) through the whole engine: prefill chunks run the
    dequantize + matmul side, decode steps (<= 16 rows) the fused GEMM, LoRA deltas on top of both."""
    awq_dir: Path = export_awq(llama.model_dir, tmp_path_factory.mktemp("awq-ours") / "m", group_size=32)
    requests = [("demo-sql", list(range(10, 40))), (None, list(range(80, 100))), ("demo-chef", [5, 6, 7])]
    runs: dict[str, list[list[TokenLogprob]]] = {}
    for kernel in ("ours", "gptqmodel"):
        engine = make_engine(
            llama, model=awq_dir, quantization="awq", awq_kernel=kernel, max_num_batched_tokens=32,
            max_num_seqs=8,
        )  # fmt: skip
        linears = [m for m in engine.loaded.model.modules() if isinstance(m, AwqLinear)]
        assert bool(linears) == (kernel == "ours")
        preload(engine, llama)
        for i, (adapter, prompt) in enumerate(requests):
            params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=5)
            ref = None if adapter is None else llama.refs[adapter]
            engine.add_request(EngineRequest(f"r{i}", prompt, params, ref))
        done = drain(engine)
        engine.close()
        runs[kernel] = [[lp for o in done[f"r{i}"] for lp in o.logprobs or ()] for i in range(len(requests))]
    ours = [[lp.token_id for lp in run] for run in runs["ours"]]
    assert all(len(t) == STEPS for t in ours)

    # Exactly the fp32 model with the checkpoint's dequantized weights (both fp32): every greedy token.
    dense = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama.model_dir), dtype=torch.float32)  # type: ignore[no-untyped-call]
    dense.load_state_dict(load_dequantized_state_dict(awq_dir), strict=False)
    reference = PeftReference(llama.model_dir, llama.adapter_dirs, base=dense)
    for (adapter, prompt), got in zip(requests, ours, strict=True):
        assert got == reference.greedy(prompt, adapter, STEPS), adapter

    # gptqmodel's kernel rounds to bf16 inside, so a near-tie may go the other way: equal tokens up to the
    # first difference, and there our pick is within bf16's reach of its best in its own top 5.
    for mine, theirs in zip(runs["ours"], runs["gptqmodel"], strict=True):
        for a, b in zip(mine, theirs, strict=True):
            if a.token_id != b.token_id:
                alternatives = dict(b.top)
                assert a.token_id in alternatives
                assert b.logprob - alternatives[a.token_id] < BF16_LOGPROB_TOL
                break
