"""The paged prefill kernel (gpu_kernels/prefill_attention.py) against a plain-torch reference.

Each case is one step: chunks with and without a cached prefix, one whose context starts mid-block, decode
rows (chunks of one token), rows no chunk owns, q a view into a fused qkv output and out a view with a row
stride, as the engine hands them. The reference attends per chunk in fp32 with a causal mask built from
absolute positions. Interpreter variants run without CUDA (fp32/fp16: the interpreter's dot is exact there),
the `gpu` variants compiled with it (tests/engine/test_gpu_kernels.py's `device` fixture).
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from deployments.engine.model.gpu_kernels.prefill_attention import paged_prefill_attention
from tests.engine.test_gpu_kernels import ROOT, device, randn

__all__ = ["device"]  # the fixture, shared with the other kernel tests


def reference_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: list[tuple[int, int, int]],  # (query_start, query_len, context_len)
    tables: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
) -> dict[int, torch.Tensor]:
    """fp32 [query_len, H, D] per chunk (keyed by its first row): each query over its own context's keys at
    positions <= its own (and > its own - window)."""
    group = q.shape[1] // k_cache.shape[1]
    q, k_cache, v_cache, tables = q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), tables.cpu()
    found = {}
    for c, (start, length, context) in enumerate(chunks):
        k_pos = torch.arange(context)
        slots = tables[c][k_pos // block_size].long() * block_size + k_pos % block_size
        k = k_cache[slots].repeat_interleave(group, 1)  # [context, H, D]
        v = v_cache[slots].repeat_interleave(group, 1)
        q_pos = torch.arange(context - length, context)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [length, context]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = torch.einsum("nhd,khd->hnk", q[start : start + length], k) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        found[start] = torch.einsum("hnk,khd->nhd", probs, v)
    return found


@dataclass(frozen=True)
class PrefillCase:
    block_size: int
    kv_heads: int
    group: int
    dim: int
    dtype: torch.dtype
    chunks: tuple[
        tuple[int, int], ...
    ]  # (cached positions before the chunk, new tokens); 1 new: a decode row
    gap: int  # packed rows left out before each chunk (owned by no chunk: must stay untouched)
    window: int | None
    block_m: int | None = None  # None: the launcher's default


PREFILL_CASES = {
    # no cache; a cached prefix starting mid-block (20 = 1.25 blocks); a decode row; a whole-block prefix
    "bs16-G4-D64-fp32": PrefillCase(
        16, 2, 4, 64, torch.float32, ((0, 37), (20, 50), (69, 1), (32, 45)), 0, None
    ),
    # many tiles per chunk (block_m 16 with G 4: 4 queries a tile), rows owned by no chunk between chunks
    "bs4-G4-D16-fp32-small-tiles": PrefillCase(
        4, 1, 4, 16, torch.float32, ((0, 23), (6, 1), (13, 30), (0, 1), (3, 17)), 2, None, block_m=16
    ),
    # block size 1, no GQA, a window shorter than the chunks, a decode row inside the window
    "bs1-G1-D16-fp16-window": PrefillCase(1, 2, 1, 16, torch.float16, ((0, 30), (13, 25), (39, 1)), 0, 8),
    # a window across the cached prefix and the block edges; about 200 rows
    "bs4-G1-D64-fp32-window": PrefillCase(
        4, 2, 1, 64, torch.float32, ((5, 60), (0, 80), (40, 58), (100, 1)), 1, 21
    ),
    # a group that is not a power of 2 (Qwen2-0.5B has 7): 64 // 3 = 21 queries a tile, one row unused
    "bs16-G3-D16-fp16": PrefillCase(16, 1, 3, 16, torch.float16, ((0, 50), (17, 40), (33, 1)), 0, None),
    # bench-1b's shape in the engine's dtype: compiled only (the interpreter's bf16 arithmetic is unusable)
    "bs16-G8-D64-bf16": PrefillCase(
        16, 2, 8, 64, torch.bfloat16, ((0, 40), (20, 50), (69, 1), (32, 45)), 0, None
    ),
}


@pytest.mark.parametrize("case", PREFILL_CASES, ids=list(PREFILL_CASES))
def test_paged_prefill_attention_matches_the_reference(case: str, device: torch.device) -> None:
    c = PREFILL_CASES[case]
    bs, kv, dim, dtype = c.block_size, c.kv_heads, c.dim, c.dtype
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("Triton's interpreter computes bf16 wrongly (gpu variant only)")
    heads = kv * c.group
    chunks: list[tuple[int, int, int]] = []  # (query_start, query_len, context_len)
    row = 0
    for cached, new in c.chunks:
        row += c.gap
        chunks.append((row, new, cached + new))
        row += new
    tokens = row + c.gap
    width = max(-(-context // bs) for _, _, context in chunks) + 1  # a spare column: never read
    num_blocks = len(chunks) * width + 3
    gen = torch.Generator().manual_seed(4)
    tables = torch.randperm(num_blocks, generator=gen)[: len(chunks) * width].view(len(chunks), width)
    qkv = randn(tokens, (heads + 2 * kv) * dim, dtype=dtype, device=device, seed=1)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k_cache = randn(num_blocks * bs, kv, dim, dtype=dtype, device=device, seed=2)
    v_cache = randn(num_blocks * bs, kv, dim, dtype=dtype, device=device, seed=3)
    scale = dim**-0.5
    want = reference_prefill(q, k_cache, v_cache, chunks, tables, bs, scale, c.window)
    out_buffer = torch.full((tokens, heads, dim + 8), 9.0, dtype=dtype, device=device)
    out = out_buffer[:, :, :dim]

    def column(i: int) -> torch.Tensor:  # int64 device tensors, as the engine's step buffer holds them
        return torch.tensor([chunk[i] for chunk in chunks], dtype=torch.int64, device=device)

    got = paged_prefill_attention(
        q, k_cache, v_cache, query_start=column(0), query_len=column(1), context_len=column(2),
        block_tables=tables.to(device), block_size=bs, scale=scale, sliding_window=c.window, out=out,
        block_m=c.block_m,
    )  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}[dtype]  # p is cast to v's dtype
    owned = torch.zeros(tokens, dtype=torch.bool)
    for start, length, _ in chunks:
        torch.testing.assert_close(
            got[start : start + length].float().cpu(),
            want[start],
            atol=tol,
            rtol=tol,
            msg=f"chunk at {start}",
        )
        owned[start : start + length] = True
    assert bool((out_buffer.cpu()[~owned] == 9.0).all())  # rows no chunk owns are left alone
    assert bool((out_buffer[:, :, dim:] == 9.0).all())  # nothing written past the view


def test_paged_prefill_attention_checks_its_arguments() -> None:
    pytest.importorskip("triton")
    cache = torch.zeros(8, 2, 16)

    def call(
        q: torch.Tensor,
        context_len: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        block_m: int | None = None,
    ) -> None:
        paged_prefill_attention(
            q, cache, cache, query_start=torch.tensor([0]), query_len=torch.tensor([4]),
            context_len=torch.tensor([4]) if context_len is None else context_len,
            block_tables=torch.tensor([[0, 1]]) if block_tables is None else block_tables,
            block_size=4, scale=1.0, block_m=block_m,
        )  # fmt: skip

    with pytest.raises(ValueError, match="context_len must be a contiguous"):
        call(torch.zeros(4, 4, 16), context_len=torch.tensor([4.0]))
    with pytest.raises(ValueError, match="block_tables must be"):
        call(torch.zeros(4, 4, 16), block_tables=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="block_m 16 must hold"):
        call(torch.zeros(4, 64, 16), block_m=16)


def test_the_module_imports_without_triton() -> None:
    """A CPU-only engine may import it: it imports, and the launcher says plainly what is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from deployments.engine.model.gpu_kernels.prefill_attention import paged_prefill_attention\n"
        "one = torch.ones(1, dtype=torch.int64)\n"
        "try:\n"
        "    x = torch.ones(1, 1, 4)\n"
        "    paged_prefill_attention(x, x, x, query_start=one, query_len=one, context_len=one,\n"
        "                            block_tables=one[None], block_size=1, scale=1.0)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "need Triton, which is not installed" in result.stdout


def test_the_attention_kernels_compile_for_sm90_without_spills() -> None:
    """The compiled path on any machine (tests/engine/sm90_compile_attention.py): the launch configurations
    for bench-1b's shapes type-check, and fit in registers (a spill would cost every K/V step)."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(triton.__file__).parents[1])])
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine.sm90_compile_attention"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(found) == 6 and all(config["spill_bytes"] == 0 for config in found.values()), found
