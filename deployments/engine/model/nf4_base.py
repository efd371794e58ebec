"""NF4Base: a bitsandbytes nf4 `Linear4bit` computed by our Triton GEMM (gpu_kernels/nf4_gemm.py) on its
own weights.

Built once per linear at load. The packed codes, the NF4 table and the bias stay the tensors bitsandbytes
put on the device (no copy). Only with double quantization (bnb_4bit_use_double_quant, off in our loader)
is the 8-bit absmax dequantized here, once, exactly as `bitsandbytes.functional.dequantize_4bit` does it
per call: fp32, one value per block of 64 weights (+1/8 of the packed weight's bytes; bitsandbytes' nested
copy stays for the module's own forward).
"""

import sys
from typing import Any

import torch
from torch import nn


class NF4Base:
    def __init__(
        self,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        code: torch.Tensor,
        *,
        out_features: int,
        in_features: int,
        blocksize: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype | None,
    ) -> None:
        self.packed = packed
        self.absmax = absmax
        self.code = code
        self.out_features = out_features
        self.in_features = in_features
        self.blocksize = blocksize
        self.bias = bias
        self.compute_dtype = compute_dtype

    @classmethod
    def of(cls, module: nn.Module) -> "NF4Base | None":
        """The kernel's view of module when it is a bitsandbytes nf4 Linear4bit in bitsandbytes' standard
        layout; None for anything else (which then runs its own forward)."""
        bnb: Any = sys.modules.get("bitsandbytes")  # not imported: no module can be a Linear4bit
        if bnb is None or not isinstance(module, bnb.nn.Linear4bit):
            return None
        weight: Any = module.weight
        state = getattr(weight, "quant_state", None)
        if state is None or state.quant_type != "nf4" or state.shape is None or len(state.shape) != 2:
            return None
        if getattr(state, "packing_format_for_cpu", False):  # repacked for bitsandbytes' AVX512 kernel
            return None
        out_features, in_features = (int(d) for d in state.shape)
        if (out_features, in_features) != (module.out_features, module.in_features):
            return None
        packed = weight.data.reshape(-1).view(torch.uint8)  # a view; quant_storage may be wider than uint8
        absmax = state.absmax
        if state.nested:
            from bitsandbytes.functional import dequantize_blockwise

            absmax = (dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
        bias = module.bias.data if isinstance(module.bias, torch.Tensor) else None
        return cls(
            packed,
            absmax.contiguous(),
            state.code.to(device=packed.device, dtype=torch.float32).contiguous(),
            out_features=out_features,
            in_features=in_features,
            blocksize=int(state.blocksize),
            bias=bias,
            compute_dtype=getattr(module, "compute_dtype", None),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Linear4bit's forward: x in its compute dtype, the result back in x's dtype."""
        from deployments.engine.model.gpu_kernels.nf4_gemm import nf4_linear

        wanted = self.compute_dtype or x.dtype
        flat = x.reshape(-1, self.in_features).to(wanted)
        y = nf4_linear(
            flat,
            self.packed,
            self.absmax,
            self.code,
            out_features=self.out_features,
            in_features=self.in_features,
            blocksize=self.blocksize,
            bias=self.bias,
        )
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
