"""Where no CUDA device exists, Triton kernels run on CPU tensors through Triton's interpreter.

Triton reads TRITON_INTERPRET when it decorates a kernel, its own library functions (tl.sum, tl.max...)
included, which happens when `triton` is first imported; transformers imports it (through torch._dynamo)
while the shared fixtures load. So tests/conftest.py imports this module first, before anything can import
Triton (tests/engine/test_gpu_kernels.py). With CUDA, Triton compiles as usual.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
