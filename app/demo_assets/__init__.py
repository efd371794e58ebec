"""The trained demo shipped with the code: `demo-llama/` (the base model) and `adapters/<skill>/` (PEFT).

Made by `python -m app.modelprep.demo_training app/demo_assets` (fixed seeds;
`demo-llama/loraplex-training.json` records the configuration, final losses and times). Shipped rather
than trained at `loraplex up`: see docs/decisions.md, issue 27.
"""

from pathlib import Path


def shipped_demo() -> Path:
    """The directory holding `demo-llama/` and `adapters/`."""
    return Path(__file__).resolve().parent
