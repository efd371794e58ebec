"""Keep what the ML stack prints at import to what an operator acts on.

torchao logs a "Failed to load" line per CUDA extension on CPU-only machines and torch's pytree
deprecation warnings when torchao registers its enums; bitsandbytes says its optional `kernels` package is
missing; transformers draws progress bars for every tiny load and warns about its own deprecations;
GPT-QModel, which PEFT imports whenever it is installed, prints a banner and environment notes to stdout.
None of these is actionable here. Call `quiet_dependencies()` at process entry (the CLI, each Serve
deployment's constructor) before those libraries are imported; real errors still surface as ERROR.
"""

import contextlib
import importlib
import importlib.util
import io
import logging
import os
import warnings

NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")


def quiet_dependencies() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow this switch
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def import_quietly(module: str) -> None:
    """Import a module that prints on import (GPT-QModel's banner) with its output discarded; a module
    that is not installed is skipped. Its import errors still raise."""
    if importlib.util.find_spec(module) is None:
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        importlib.import_module(module)
