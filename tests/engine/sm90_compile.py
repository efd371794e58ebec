"""Compiles the NF4 kernels (and the elementwise kernels' CUDA-only branches: libdevice's expf and tanhf,
Gemma's unit-offset norm; the group LoRA kernel with adapters of one page and in runs of pages) for sm90
(H100/H200) on any machine: Triton's frontend, its MLIR passes, LLVM and the ptxas it ships all run without
a GPU. Run in a process without TRITON_INTERPRET (the kernels must be JIT functions, not interpreted ones);
prints one JSON object: each launch configuration's shared memory per program. The NF4 configurations are
the ones `nf4_linear` launches for bench-1b's shapes.
"""

import json
import os

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from deployments.engine.model.gpu_kernels import activation, lora_delta, nf4_gemm, rms_norm

GEMM_ARGS: list[str] = nf4_gemm._nf4_gemm_kernel.arg_names[:15]  # the runtime arguments, constexprs after
# What Triton's launcher specializes for bench-1b's shapes: 16-byte aligned pointers, ints divisible by 16.
DIVISIBLE = ("x_ptr", "packed_ptr", "absmax_ptr", "code_ptr", "bias_ptr", "out_ptr", "N", "K", "row_bytes",
             "stride_xm", "stride_om", "split_len", "stride_split")  # fmt: skip


def _gemm(x: str, out: str, **constants: object) -> int:
    types = [f"*{x}", "*u8", "*fp32", "*fp32", f"*{x}", f"*{out}"] + ["i32"] * 9
    signature = dict(zip(GEMM_ARGS, types, strict=True))
    consts: dict[str, object] = {
        "BLOCKSIZE": 64, "ALIGNED": True, "EVEN_K": True, "HAS_BIAS": False, "BLOCK_M": 32,
        "BLOCK_N": nf4_gemm.BLOCK_N, "BLOCK_K": nf4_gemm.BLOCK_K, "SUB": 64, "PRECISION": "tf32",
    }  # fmt: skip
    consts.update(constants)
    signature.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(GEMM_ARGS.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE}
    source = ASTSource(nf4_gemm._nf4_gemm_kernel, signature, consts, attrs)
    options = {"num_warps": nf4_gemm.NUM_WARPS, "num_stages": nf4_gemm.NUM_STAGES}
    return int(compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared)


def _lora_delta(runs: bool, block_r: int) -> int:
    """The group LoRA kernel at a decode configuration in bf16: one page an adapter (rank 16), or runs of
    up to four pages of 16 (BLOCK_R 64)."""
    kernel = lora_delta._delta_kernel
    pointers = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "ends_ptr": "*i64", "runs_ptr": "*i64",
                "y_ptr": "*bf16"}  # fmt: skip
    consts: dict[str, object] = {
        "BLOCK_M": 16, "BLOCK_K": 256, "BLOCK_R": block_r, "BLOCK_N": 128, "COLUMNS": 128, "BLOCK_S": 64,
        "PRECISION_A": "tf32", "PRECISION_B": "tf32", "RUNS": runs,
    }  # fmt: skip
    signature = {name: pointers.get(name, "i32") for name in kernel.arg_names}
    signature.update(dict.fromkeys(consts, "constexpr"))
    source = ASTSource(kernel, signature, consts)
    options = {"num_warps": 4, "num_stages": 4}
    return int(compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared)


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"
    target = GPUTarget("cuda", 90, 32)
    shared = {
        "decode_split_partials": _gemm("bf16", "fp32"),
        "decode_bias": _gemm("bf16", "bf16", HAS_BIAS=True),
        "tiled_rows64": _gemm("bf16", "bf16", BLOCK_M=64),
        "fp32_ieee": _gemm("fp32", "fp32", BLOCK_M=16, PRECISION="ieee"),
        "any_shape_fp16": _gemm("fp16", "fp16", ALIGNED=False, EVEN_K=False),
    }
    split = ASTSource(
        nf4_gemm._split_sum_kernel,
        {"partial_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "stride_split": "i32",
         "stride_om": "i32", "SPLITS": "constexpr", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"},
        {"SPLITS": 8, "HAS_BIAS": True, "BLOCK": nf4_gemm.REDUCE_BLOCK},
    )  # fmt: skip
    shared["split_sum"] = int(compile(split, target=target).metadata.shared)
    dequant = ASTSource(
        nf4_gemm._nf4_dequant_kernel,
        {"packed_ptr": "*u8", "absmax_ptr": "*fp32", "code_ptr": "*fp32", "out_ptr": "*bf16", "numel": "i32",
         "BLOCKSIZE": "constexpr", "BLOCK": "constexpr"},
        {"BLOCKSIZE": 64, "BLOCK": nf4_gemm.DEQUANT_BLOCK},
    )  # fmt: skip
    shared["dequant"] = int(compile(dequant, target=target).metadata.shared)
    for name, act in (("silu", activation.SILU), ("gelu_tanh", activation.GELU_TANH)):
        gated = ASTSource(
            activation._gated_kernel,
            {"gate_up_ptr": "*bf16", "out_ptr": "*bf16", "stride_g": "i32", "stride_o": "i32", "inter": "i32",
             "BLOCK": "constexpr", "ACTIVATION": "constexpr", "ACCURATE": "constexpr"},
            {"BLOCK": activation.BLOCK, "ACTIVATION": act, "ACCURATE": True},
        )  # fmt: skip
        shared[name] = int(compile(gated, target=target).metadata.shared)
    norm = ASTSource(
        rms_norm._rms_norm_kernel,
        {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*fp32", "out_ptr": "*bf16",
         "residual_out_ptr": "*bf16", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32",
         "stride_ro": "i32", "eps": "fp32", "N": "constexpr", "BLOCK": "constexpr",
         "HAS_RESIDUAL": "constexpr", "UNIT_OFFSET": "constexpr"},
        {"N": 2304, "BLOCK": 4096, "HAS_RESIDUAL": True, "UNIT_OFFSET": True},
    )  # fmt: skip
    shared["gemma_norm"] = int(compile(norm, target=target, options={"num_warps": 8}).metadata.shared)
    for name, runs, block_r in (("lora_delta", False, 16), ("lora_delta_runs", True, 64)):
        shared[name] = _lora_delta(runs, block_r)
    print(json.dumps(shared))


if __name__ == "__main__":
    main()
