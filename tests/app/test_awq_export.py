"""AWQ GEMM export, loading it through transformers + gptqmodel on CPU, and the facts the engine relies on
about bitsandbytes nf4/int8 on CPU and PEFT over quantized bases.

Tolerances: gptqmodel's CPU AWQ kernel (TorchAtenAwqLinear, aten._weight_int4pack_mm_for_cpu) casts
activations and scales to bf16 (8-bit mantissa), so the served model differs from a float32 model holding the
exactly dequantized weights by ~0.4% relative (measured); we allow 2% relative (Frobenius) and 0.03 absolute
on logits of magnitude ~1. RTN int4 itself (group 64, random-init weights) moves the logits ~15% relative
from the original float32 model; we allow 30%.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from app.modelprep.awq_export import (
    GEMM_PACK_ORDER,
    AwqExportError,
    dequantize_gemm,
    dequantize_module,
    export_awq,
    load_dequantized_state_dict,
    main,
    pack_gemm,
    quantize_rtn,
    unpack_gemm,
)
from tests.ci import missing

GROUP = 64
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOGITS_REL_TOL = 2e-2
LOGITS_ABS_TOL = 3e-2
RTN_REL_TOL = 0.3


def tiny_config(**overrides: Any) -> LlamaConfig:
    shape: dict[str, Any] = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 512,
    }
    return LlamaConfig(**(shape | overrides))


def save_tiny(path: Path, **overrides: Any) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config(**overrides)).save_pretrained(path)
    return path


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_tiny(tmp_path_factory.mktemp("tiny") / "model")
    (path / "tokenizer_config.json").write_text("{}\n")  # stands in for the tokenizer files to be copied
    return path


@pytest.fixture(scope="module")
def awq_dirs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("awq")
    return {
        zp: export_awq(tiny_dir, root / f"zp{zp:d}", group_size=GROUP, zero_point=zp) for zp in (True, False)
    }


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, 512, (3, 12), generator=torch.Generator().manual_seed(2))


def original_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def dense_dequantized(awq_dir: Path) -> Any:
    config = AutoConfig.from_pretrained(awq_dir)
    del config.quantization_config
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(load_dequantized_state_dict(awq_dir))
    return model.eval()


def load_awq(awq_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(awq_dir, device_map="cpu", dtype=dtype)
    return model.eval()


# --- packing and RTN ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_pack_matches_gptqmodel_and_rtn_error_is_half_a_step(group_size: int, zero_point: bool) -> None:
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm as gptq_dequantize
    from gptqmodel.quantization.awq.utils.packing_utils import pack_awq

    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.05
    codes, zeros, scales = quantize_rtn(weight, group_size, zero_point=zero_point)
    assert tuple(codes.shape) == (384, 256)
    assert tuple(zeros.shape) == tuple(scales.shape) == (384 // group_size, 256)
    assert scales.dtype == torch.float16
    assert 0 <= int(codes.min()) <= int(codes.max()) <= 15
    ref_qweight, ref_qzeros = pack_awq(codes, zeros, 4)
    assert torch.equal(pack_gemm(codes), ref_qweight)
    assert torch.equal(pack_gemm(zeros), ref_qzeros)
    assert torch.equal(unpack_gemm(pack_gemm(codes)), codes)
    if not zero_point:
        assert bool((zeros == 8).all())

    dense = dequantize_gemm(pack_gemm(codes), pack_gemm(zeros), scales, group_size)
    theirs = gptq_dequantize(pack_gemm(codes), pack_gemm(zeros), scales, 4, group_size).float().t()
    torch.testing.assert_close(dense, theirs, rtol=0, atol=1e-4)  # theirs is rounded to fp16
    half_step = scales.float().t().repeat_interleave(group_size, dim=1) / 2
    assert bool(((dense - weight).abs() <= half_step * (1 + 1e-5)).all())


def test_pack_order_is_awq_interleaved() -> None:
    codes = torch.arange(8, dtype=torch.int32)[None, :]  # column c holds code c
    word = int(pack_gemm(codes)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == list(GEMM_PACK_ORDER) == [0, 2, 4, 6, 1, 3, 5, 7]


def test_group_that_does_not_straddle_zero_is_not_clipped() -> None:
    weight = torch.stack([torch.full((64,), 0.5), torch.linspace(1, 2, 64), -torch.linspace(1, 2, 64)])
    weight = torch.cat([weight, torch.zeros(5, 64)])
    codes, zeros, scales = quantize_rtn(weight, 64)
    dense = dequantize_gemm(pack_gemm(codes), pack_gemm(zeros), scales, 64)
    assert bool(((dense - weight).abs() <= scales.float().t() / 2 * (1 + 1e-5)).all())


# --- the exported checkpoint --------------------------------------------------------------------------------


def test_export_writes_awq_gemm_checkpoint(tiny_dir: Path, awq_dirs: dict[bool, Path]) -> None:
    out = awq_dirs[True]
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float16"
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "format": "gemm",
        "modules_to_not_convert": ["lm_head"],
    }
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer_config.json",
    ]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        qweight = f.get_tensor("model.layers.1.mlp.down_proj.qweight")  # in=256, out=128
        qzeros = f.get_tensor("model.layers.1.mlp.down_proj.qzeros")
        scales = f.get_tensor("model.layers.1.mlp.down_proj.scales")
        embed = f.get_tensor("model.embed_tokens.weight")
    assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (256, 16))
    assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (256 // GROUP, 16))
    assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (256 // GROUP, 128))
    assert embed.dtype == torch.float16
    assert {"lm_head.weight", "model.norm.weight"} <= keys
    assert not any(k.endswith("_proj.weight") for k in keys)
    assert sum(k.endswith(".qweight") for k in keys) == 2 * 7


def test_wrong_group_size_raises_clearly(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(AwqExportError, match=r"group_size must be one of \(16, 32, 64, 128\).*got 96"):
        export_awq(tiny_dir, tmp_path / "a", group_size=96)
    odd = save_tiny(tmp_path / "odd", hidden_size=96, intermediate_size=192)  # in_features 96 and 192
    with pytest.raises(AwqExportError, match=r"group_size 128 must divide in_features (96|192) of model\."):
        export_awq(odd, tmp_path / "b", group_size=128)
    assert not (tmp_path / "b").exists()  # nothing half-written
    export_awq(odd, tmp_path / "c", group_size=32)  # 32 divides both


def test_refuses_nonempty_out_and_quantized_source(awq_dirs: dict[bool, Path], tiny_dir: Path) -> None:
    with pytest.raises(AwqExportError, match="not an empty directory"):
        export_awq(tiny_dir, awq_dirs[True])
    with pytest.raises(AwqExportError, match="already quantized"):
        export_awq(awq_dirs[True], awq_dirs[True].parent / "again")


def test_cli(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tiny_dir), str(tmp_path / "cli"), "--group-size", "128"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["quantization_config"]["group_size"] == 128
    with pytest.raises(SystemExit):
        main([str(tiny_dir), str(tmp_path / "bad"), "--group-size", "96"])


# --- loading through transformers + gptqmodel on CPU --------------------------------------------------------


@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_loads_through_gptqmodel_and_matches_dequantized_reference(
    tiny_dir: Path, awq_dirs: dict[bool, Path], ids: torch.Tensor, zero_point: bool
) -> None:
    from gptqmodel.nn_modules.qlinear import AWQuantLinear

    awq = load_awq(awq_dirs[zero_point])
    q_proj = awq.model.layers[0].self_attn.q_proj
    # AUTO backend on CPU picks gptqmodel's ATen int4 kernel; lm_head stays a plain Linear.
    assert type(q_proj).__name__ == "TorchAtenAwqLinear"
    assert isinstance(q_proj, AWQuantLinear)
    assert type(awq.lm_head) is torch.nn.Linear
    assert (q_proj.in_features, q_proj.out_features) == (128, 128)
    assert awq.model.layers[0].mlp.down_proj.in_features == 256

    # Loaded buffers are the exported ones: dequantized, each weight is within half a step of the original.
    originals = original_weights(tiny_dir)
    quantized = {n: m for n, m in awq.named_modules() if isinstance(m, AWQuantLinear)}
    assert len(quantized) == 14
    for name, module in quantized.items():
        half_step = module.scales.float().t().repeat_interleave(GROUP, dim=1) / 2
        err = (dequantize_module(module) - originals[f"{name}.weight"]).abs()
        assert bool((err <= half_step * (1 + 1e-5)).all()), name

    with torch.inference_mode():
        logits = awq(ids).logits
        reference = dense_dequantized(awq_dirs[zero_point])(ids).logits
        original = AutoModelForCausalLM.from_pretrained(tiny_dir)(ids).logits
    assert logits.dtype == torch.float32
    assert rel(logits, reference) < LOGITS_REL_TOL
    assert float((logits - reference).abs().max()) < LOGITS_ABS_TOL
    assert rel(logits, original) < RTN_REL_TOL

    # The first no-grad eval forward repacked the buffers for aten's int4pack kernel: no longer AWQ tensors.
    assert (q_proj.linear_mode, q_proj.qweight.dtype) == ("inference", torch.uint8)
    with pytest.raises(AwqExportError, match="repacked"):
        dequantize_module(q_proj)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_awq_linear_takes_2d_and_3d_inputs(awq_dirs: dict[bool, Path], dtype: torch.dtype) -> None:
    awq = load_awq(awq_dirs[True], dtype)
    q_proj = awq.model.layers[0].self_attn.q_proj
    dense = dequantize_module(q_proj)
    x = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        y3, y2 = q_proj(x), q_proj(x[0])
    assert (y3.shape, y2.shape, y3.dtype, y2.dtype) == ((1, 5, 128), (5, 128), dtype, dtype)
    # The kernel computes in bf16 whatever the input dtype.
    assert rel(y2, x[0].float() @ dense.t()) < LOGITS_REL_TOL
    torch.testing.assert_close(y3[0], y2)


def test_memory_footprints(tiny_dir: Path, awq_dirs: dict[bool, Path]) -> None:
    def footprint(path: Path, **kwargs: Any) -> int:
        model: Any = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kwargs)
        return int(model.get_memory_footprint())

    fp32 = footprint(tiny_dir, dtype=torch.float32)
    bf16 = footprint(tiny_dir, dtype=torch.bfloat16)
    awq_bf16 = footprint(awq_dirs[True], dtype=torch.bfloat16)
    awq_fp32 = footprint(awq_dirs[True], dtype=torch.float32)
    assert (fp32, bf16) == (1_706_624, 853_376)  # 426,656 parameters (bf16 keeps fp32 rotary buffers)
    # Only the decoder projections are int4; embeddings and lm_head (a third of this tiny model) stay dense.
    assert awq_bf16 == footprint(awq_dirs[True]) == 422_528 < bf16
    assert awq_bf16 < awq_fp32 == 685_952 < fp32


# --- bitsandbytes on CPU ------------------------------------------------------------------------------------


def load_bnb(model_dir: Path, kind: str, dtype: torch.dtype) -> Any:
    bnb_config: Any = BitsAndBytesConfig  # untyped constructor
    if kind == "nf4":
        qc = bnb_config(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    else:
        qc = bnb_config(load_in_8bit=True)
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            model_dir, device_map="cpu", dtype=dtype, quantization_config=qc
        )
        return model.eval()
    except (ImportError, RuntimeError, NotImplementedError) as exc:
        missing(f"bitsandbytes cannot load {kind} on CPU here: {exc}")


@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "cls", "tol"), [("nf4", "Linear4bit", 0.3), ("int8", "Linear8bitLt", 0.05)])
def test_bnb_loads_and_runs_on_cpu(
    tiny_dir: Path, ids: torch.Tensor, kind: str, cls: str, tol: float, dtype: torch.dtype
) -> None:
    import bitsandbytes as bnb

    model = load_bnb(tiny_dir, kind, dtype)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == cls
    assert isinstance(q_proj, getattr(bnb.nn, cls))
    assert (q_proj.in_features, q_proj.out_features) == (128, 128)
    assert type(model.lm_head) is torch.nn.Linear
    # nf4 packs two codes per byte into a flat [out*in/2, 1] uint8; int8 keeps [out, in] int8.
    expected = (torch.uint8, (128 * 128 // 2, 1)) if kind == "nf4" else (torch.int8, (128, 128))
    assert (q_proj.weight.dtype, tuple(q_proj.weight.shape)) == expected

    dense = original_weights(tiny_dir)["model.layers.0.self_attn.q_proj.weight"]
    for x_dtype in (torch.float32, torch.bfloat16, torch.float16):  # any float input works; out dtype = in
        x = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(0)).to(x_dtype)
        with torch.inference_mode():
            y3, y2 = q_proj(x), q_proj(x[0])
        assert (y3.shape, y2.shape, y3.dtype, y2.dtype) == ((1, 5, 128), (5, 128), x_dtype, x_dtype)
        assert rel(y2, x[0].float() @ dense.t()) < tol

    with torch.inference_mode():
        logits = model(ids).logits
        original = AutoModelForCausalLM.from_pretrained(tiny_dir)(ids).logits
    assert logits.dtype == dtype
    assert rel(logits, original) < tol


# --- PEFT as the reference over quantized bases -------------------------------------------------------------


def lora_config(seed: int) -> Any:
    from peft import LoraConfig

    torch.manual_seed(seed)
    return LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights=False)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from peft import get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, name in enumerate(("a1", "a2")):
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir), lora_config(seed))
        with torch.no_grad():  # a delta comparable to the base output, so adapter mix-ups show
            for pname, param in peft_model.named_parameters():
                if "lora_B" in pname:
                    param.mul_(5)
        peft_model.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def with_adapters(base: Any, adapter_dirs: dict[str, Path]) -> Any:
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, adapter_dirs["a1"], adapter_name="a1")
    model.load_adapter(adapter_dirs["a2"], adapter_name="a2")
    return model.eval()


MIXED = ["a1", "a2", "__base__"]


def per_adapter_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    rows = []
    with torch.inference_mode():
        for i, name in enumerate(MIXED):
            if name == "__base__":
                with model.disable_adapter():
                    rows.append(model(ids[i : i + 1]).logits)
            else:
                model.set_adapter(name)
                rows.append(model(ids[i : i + 1]).logits)
    return torch.cat(rows).float()


@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
@pytest.mark.parametrize(
    ("kind", "wrapper", "atol"), [("nf4", "Linear4bit", 1e-4), ("int8", "Linear8bitLt", 3e-2)]
)
def test_peft_mixed_batch_over_bnb(
    tiny_dir: Path, adapter_dirs: dict[str, Path], ids: torch.Tensor, kind: str, wrapper: str, atol: float
) -> None:
    model = with_adapters(load_bnb(tiny_dir, kind, torch.float32), adapter_dirs)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert f"{type(q_proj).__module__}.{type(q_proj).__name__}" == f"peft.tuners.lora.bnb.{wrapper}"
    solo = per_adapter_logits(model, ids)
    with torch.inference_mode():
        mixed = model(ids, adapter_names=MIXED).logits.float()
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=MIXED, max_new_tokens=3,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    # LLM.int8 picks outlier columns over the whole batch, so int8 rows depend slightly on their neighbours.
    torch.testing.assert_close(mixed, solo, rtol=0, atol=atol)
    assert tuple(out.shape) == (3, 15)


def test_peft_over_awq_wraps_but_cannot_mix_so_reference_is_the_dequantized_dense_copy(
    awq_dirs: dict[bool, Path], adapter_dirs: dict[str, Path], ids: torch.Tensor
) -> None:
    awq = with_adapters(load_awq(awq_dirs[True]), adapter_dirs)
    q_proj = awq.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "AwqLoraLinear"
    assert type(q_proj.get_base_layer()).__name__ == "TorchAtenAwqLinear"
    solo_awq = per_adapter_logits(awq, ids)  # one adapter per forward works
    # AwqLoraLinear.forward(x) takes no adapter_names: PEFT's mixed-batch hook breaks it.
    with torch.inference_mode(), pytest.raises(TypeError, match="adapter_names"):
        awq(ids, adapter_names=MIXED)

    # The same effective weights in a dense fp32 model: PEFT mixes adapters there.
    dense = with_adapters(dense_dequantized(awq_dirs[True]), adapter_dirs)
    with torch.inference_mode():
        mixed_dense = dense(ids, adapter_names=MIXED).logits.float()
    assert rel(solo_awq, mixed_dense) < LOGITS_REL_TOL
    assert float((solo_awq - mixed_dense).abs().max()) < LOGITS_ABS_TOL
