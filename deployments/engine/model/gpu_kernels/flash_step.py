"""The inner step the decode and prefill attention kernels share: where a run of context positions lies in
the paged cache, and one online-softmax update. Triton inlines them into each kernel."""

from __future__ import annotations

from deployments.engine.model.gpu_kernels._triton import jit, tl


@jit
def cache_slots(table_row, offs_n, valid, BLOCK_SIZE: tl.constexpr):
    """[BLOCK_N] flat slots of context positions offs_n, through one sequence's block table. Rows are found
    position by position, so a tile never assumes a block holds it whole: any block_size from 1 up."""
    block_ids = tl.load(table_row + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block_ids * BLOCK_SIZE + offs_n % BLOCK_SIZE


@jit
def online_softmax(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold scores s [M, N] (log2 units, -inf where masked) and values v [N, D] into the running max m_i
    [M], running sum of exp2(s - m_i) l_i [M] and unnormalised output acc [M, D] (all fp32). m_i starts
    finite (-1e30), so a row that has seen only masked positions stays NaN-free."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
