"""AwqLinear: an AWQ "GEMM" int4 linear of ours, computed by our Triton kernels (gpu_kernels/awq_gemm.py,
awq_dequant.py) on the checkpoint's own packed tensors, so an AWQ base runs where gptqmodel does not install
(the GPU image) and inside the captured decode graphs.

It holds qweight int32 [in, out / 8], qzeros int32 [in / group, out / 8] and scales [in / group, out] in the
compute dtype (layout: awq_dequant.py's docstring). Per call, by the call's row count (a static shape per
decode bucket, so the choice is fixed inside a captured graph):
- rows <= fused_max_rows: awq_linear, one kernel that reads the 4-bit codes only (decode reads each weight
  once a step, so this saves the 16-bit copy's write and read);
- more rows: awq_dequantize once, then one dense matmul. The default sends every call here: on an H200
  (bench.gpu_check's awq step, bench-1b's 2048 x 5632) dequantize + matmul took 101-105 us at 1-256 rows
  and the fused kernel 240 us at 1 row, 613 us at 256, so the fused side waits for a tuned kernel.
Without Triton (a CPU engine where gptqmodel is missing) the same weight is dequantized in torch per call.
LoRA wraps it like any base (MultiLoRALinear, Projection's per-member path); nothing here knows adapters.
"""

import torch
from torch import nn

from deployments.engine.model.gpu_kernels._triton import interpreting, triton

# Column c of each block of 8 sits in nibble (0 2 4 6 1 3 5 7).index(c): bits 4 * that.
_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)
DEFAULT_FUSED_MAX_ROWS = 0  # the fused GEMM was slower at every row count measured


def dequantize_in_torch(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """awq_dequantize's weight [in, out] (rounded once to the scales' dtype) in plain torch, for a CPU
    without Triton: it materializes int32 codes, so it is for that fallback only."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device)
    codes = ((qweight[..., None] >> shifts) & 0xF).flatten(1)
    zeros = ((qzeros[..., None] >> shifts) & 0xF).flatten(1).repeat_interleave(group_size, 0)
    wide = scales.float().repeat_interleave(group_size, 0)
    return ((codes - zeros).float() * wide).to(scales.dtype)


class AwqLinear(nn.Module):
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        *,
        group_size: int,
        bias: torch.Tensor | None = None,
        fused_max_rows: int = DEFAULT_FUSED_MAX_ROWS,
    ) -> None:
        super().__init__()
        in_features, words = qweight.shape
        out_features = words * 8
        groups = in_features // group_size
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise ValueError("AWQ qweight and qzeros must be int32 (GEMM packing)")
        if group_size < 16 or group_size & (group_size - 1) or in_features % group_size:
            raise ValueError(f"AWQ group_size {group_size} must be a power of 2 >= 16 dividing {in_features}")
        if qzeros.shape != (groups, words) or scales.shape != (groups, out_features):
            raise ValueError(
                f"AWQ qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not match qweight "
                f"{tuple(qweight.shape)} with group_size {group_size}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.fused_max_rows = fused_max_rows
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("qzeros", qzeros.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.contiguous())

    @property
    def uses_triton(self) -> bool:
        """Our kernels run where Triton compiles (CUDA) or interprets (CPU tensors, the tests)."""
        return triton is not None and (self.qweight.is_cuda or interpreting())

    def dequantized(self) -> torch.Tensor:
        """The dense weight [in, out] in the scales' dtype: x @ it is this layer's output, bias aside."""
        if self.uses_triton:
            from deployments.engine.model.gpu_kernels.awq_dequant import awq_dequantize

            return awq_dequantize(self.qweight, self.qzeros, self.scales, self.group_size)
        return dequantize_in_torch(self.qweight, self.qzeros, self.scales, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scales.dtype)
        if self.uses_triton and flat.shape[0] <= self.fused_max_rows:
            from deployments.engine.model.gpu_kernels.awq_gemm import awq_linear

            y = awq_linear(flat.contiguous(), self.qweight, self.qzeros, self.scales, self.group_size)
        else:
            y = flat @ self.dequantized()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, fused_max_rows={self.fused_max_rows}"
        )
