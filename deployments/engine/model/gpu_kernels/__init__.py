"""Triton kernels for the CUDA engine: pure functions over the engine's buffers, one noun per module.

Every launcher is CUDA-graph safe: grids come from tensor shapes only, nothing reads a tensor's values on
the host, and loop bounds that depend on data (context lengths, LoRA segment ends) are loaded inside the
kernels. The modules import without Triton (their launchers then raise); with TRITON_INTERPRET=1 set before
the first import the same kernels run on CPU tensors through Triton's interpreter, which is how the tests
run them where no GPU is present.
"""
