"""Compiles the attention kernels for sm90 (H100/H200) on any machine and reads ptxas's resource report:
Triton's frontend, its MLIR passes, LLVM and the ptxas it ships all run without a GPU, and the interpreter
the CPU suite runs them in checks neither compiled types nor register spills. Run in a process without
TRITON_INTERPRET (the kernels must be JIT functions); prints one JSON object: per launch configuration,
its registers, spilled bytes and shared memory per program. The configurations are the ones the launchers
pick for bench-1b's shapes (bf16, G 8, head_dim 64, block 16), plus head_dim 128 and a group of 7.
"""

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from deployments.engine.model.gpu_kernels import paged_attention, prefill_attention

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _resources(
    kernel: object, types: list[str], consts: dict[str, object], divisible: list[str]
) -> dict[str, int]:
    """Compile with what Triton's launcher specializes for the engine's tensors (16-byte aligned pointers,
    strides divisible by 16), then ask ptxas for registers and spills."""
    names: list[str] = kernel.arg_names  # type: ignore[attr-defined]
    warps = int(consts.pop("num_warps", 4))  # type: ignore[call-overload]
    signature = dict(zip(names, types, strict=False)) | dict.fromkeys(consts, "constexpr")
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    compiled = compile(
        ASTSource(kernel, signature, consts, attrs), target=TARGET, options={"num_warps": warps}
    )
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run(
            [str(PTXAS), "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert registers is not None, report
    return {
        "registers": int(registers[1]),
        "spill_bytes": sum(spills),
        "shared": int(compiled.metadata.shared),
    }


def _prefill(dtype: str, group: int, dim: int, window: bool) -> dict[str, int]:
    kernel = prefill_attention._prefill_kernel
    types = [f"*{dtype}"] * 4 + ["*i64"] * 4 + ["i32"] * 10 + ["fp32", "i32"]
    consts: dict[str, object] = {
        **prefill_attention.launch_config(group, dim, None, None), "BLOCK_SIZE": 16, "HAS_WINDOW": window,
        "SCAN_C": prefill_attention.SCAN, "PRECISION": "tf32",
    }  # fmt: skip
    divisible = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_ks", "stride_kh",
                 "stride_vs", "stride_vh", "stride_ot", "stride_oh"]  # fmt: skip
    return _resources(kernel, types, consts, divisible)


def _decode(split: bool) -> dict[str, int]:
    kernel = paged_attention._attend_kernel
    types = (
        ["*bf16"] * 3 + ["*i64"] * 2 + ["*bf16"] + ["*fp32"] * 3 + ["i32"] * 9 + ["fp32", "i32", "i32", "i32"]
    )
    consts: dict[str, object] = {
        "G": 8, "G_PAD": 16, "D": 64, "D_PAD": 64, "BLOCK_SIZE": 16, "BLOCK_N": 128, "HAS_WINDOW": False,
        "SPLIT": split, "PRECISION": "tf32",
    }  # fmt: skip
    divisible = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "stride_qb", "stride_qh", "stride_ks", "stride_kh",
                 "stride_vs", "stride_vh", "stride_ob", "stride_oh"]  # fmt: skip
    return _resources(kernel, types, consts, divisible)


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"
    found = {
        "prefill_bf16_G8_D64": _prefill("bf16", 8, 64, False),
        "prefill_bf16_G8_D64_window": _prefill("bf16", 8, 64, True),
        "prefill_fp16_G1_D128": _prefill("fp16", 1, 128, False),
        "prefill_bf16_G7_D64": _prefill("bf16", 7, 64, False),
        "decode_bf16_G8_D64": _decode(False),
        "decode_bf16_G8_D64_split": _decode(True),
    }
    print(json.dumps(found))


if __name__ == "__main__":
    main()
