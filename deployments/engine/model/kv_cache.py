"""KVCache: the engine's paged K/V tensors, one flat [(num_blocks + 1) * block_size, Hkv, D] pair per layer.

Block `num_blocks` is the sink: never handed to a sequence, it takes the K/V writes of a decode bucket's
padding rows (step_inputs.py), so padding never touches anyone's context.
"""

import torch


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = ((num_blocks + 1) * block_size, num_kv_heads, head_dim)  # + the sink block
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    @staticmethod
    def blocks_for_budget(
        budget_bytes: int,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many blocks fit in `budget_bytes` (K and V, every layer)."""
        per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        return max(2, budget_bytes // per_block - 1)  # one block of the budget is the sink
