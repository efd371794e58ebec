from pathlib import Path
from typing import Any

import pytest
import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from adapters.errors import AdapterInvalid
from adapters.spec import WEIGHTS_FILE, AdapterSpec
from adapters.weights import load_adapter_weights
from tests.adapters.conftest import edit_tensors, lora_key, peft_model

PREFIX = "base_model.model."
PATTERNS: dict[str, Any] = {
    "rank_pattern": {"layers.0.self_attn.q_proj": 2, "down_proj": 8},
    "alpha_pattern": {"v_proj": 3, "layers.1.mlp.gate_proj": 40},
}


@pytest.mark.parametrize(
    "lora_kwargs",
    [
        {"r": 4, "lora_alpha": 8},
        {"r": 4, "lora_alpha": 8, "use_rslora": True, **PATTERNS},
        {"r": 6, "lora_alpha": 5, **PATTERNS},
    ],
)
def test_folded_weights_reproduce_the_peft_layer(
    base_model_dir: Path, tmp_path: Path, lora_kwargs: Any
) -> None:
    model = peft_model(base_model_dir, seed=3, **lora_kwargs)
    model.save_pretrained(str(tmp_path))
    weights = load_adapter_weights(tmp_path, AdapterSpec.from_dir(tmp_path), dtype=torch.float32)
    layers: dict[str, Any] = {
        name.removeprefix(PREFIX): m for name, m in model.named_modules() if isinstance(m, LoraLayer)
    }
    assert set(weights.modules) == set(layers)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for path, layer in layers.items():
            w = weights.modules[path]
            x = torch.randn(5, w.a.shape[1], generator=generator)
            ours = layer.get_base_layer()(x) + (x @ w.a.T) @ w.b.T
            torch.testing.assert_close(ours, layer(x), rtol=1e-5, atol=1e-5, msg=path)
    assert weights.rank == max(m.a.shape[0] for m in weights.modules.values())


def test_fold_is_done_in_float32_then_cast(good_adapter: Path) -> None:
    spec = AdapterSpec.from_dir(good_adapter)
    raw = load_file(good_adapter / WEIGHTS_FILE)
    weights = load_adapter_weights(good_adapter, spec, dtype=torch.bfloat16)
    path = "model.layers.1.mlp.up_proj"
    module = weights.modules[path]
    assert module.a.dtype == module.b.dtype == torch.bfloat16
    assert torch.equal(module.b, (raw[lora_key(path, "B")] * spec.scaling_for(path)).to(torch.bfloat16))
    assert torch.equal(module.a, raw[lora_key(path, "A")].to(torch.bfloat16))
    assert weights.nbytes == sum(2 * (m.a.numel() + m.b.numel()) for m in weights.modules.values())
    assert weights.rank == 4


def test_adapter_name_in_keys_is_tolerated(adapter_copy: Path) -> None:
    def rename(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[key.replace(".weight", ".default.weight")] = tensors.pop(key)

    edit_tensors(adapter_copy, rename)
    weights = load_adapter_weights(adapter_copy, AdapterSpec.from_dir(adapter_copy), dtype=torch.float32)
    assert len(weights.modules) == 14


def test_missing_half_is_an_error(adapter_copy: Path) -> None:
    edit_tensors(adapter_copy, lambda t: t.pop(lora_key("model.layers.0.self_attn.k_proj", "B")))
    with pytest.raises(AdapterInvalid, match=r"model\.layers\.0\.self_attn\.k_proj has no lora_B"):
        load_adapter_weights(adapter_copy, AdapterSpec.from_dir(adapter_copy), dtype=torch.float32)


def test_unexpected_tensor_is_an_error(adapter_copy: Path) -> None:
    edit_tensors(adapter_copy, lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(2, 2)}))
    with pytest.raises(AdapterInvalid, match=r"unexpected tensor base_model\.model\.lm_head\.weight"):
        load_adapter_weights(adapter_copy, AdapterSpec.from_dir(adapter_copy), dtype=torch.float32)


def test_pickle_weights_are_never_read(adapter_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = AdapterSpec.from_dir(adapter_copy)
    tensors = load_file(adapter_copy / WEIGHTS_FILE)
    (adapter_copy / WEIGHTS_FILE).unlink()
    torch.save(tensors, adapter_copy / "adapter_model.bin")
    monkeypatch.setattr(torch, "load", pytest.fail)
    with pytest.raises(AdapterInvalid, match=f"missing {WEIGHTS_FILE}"):
        load_adapter_weights(adapter_copy, spec, dtype=torch.float32)


def test_loads_onto_the_requested_device(good_adapter: Path) -> None:
    weights = load_adapter_weights(
        good_adapter, AdapterSpec.from_dir(good_adapter), dtype=torch.float16, device=torch.device("meta")
    )
    module = next(iter(weights.modules.values()))
    assert module.a.device.type == module.b.device.type == "meta"
    assert module.b.dtype == torch.float16


def test_loaded_weights_outlive_their_file_being_rewritten(adapter_copy: Path) -> None:
    """Loaded weights hold no view of the file: rewriting it in place (truncated) afterwards must not end
    the process with SIGBUS when they are read (an engine fills slots from a host tier of these)."""
    import subprocess
    import sys

    code = f"""
import torch
from pathlib import Path
from adapters.spec import AdapterSpec
from adapters.weights import load_adapter_weights
path = Path({str(adapter_copy)!r})
spec = AdapterSpec.from_dir(path)
weights = load_adapter_weights(path, spec, dtype=torch.float32)
(path / {WEIGHTS_FILE!r}).write_bytes(b"broken")
print(sum(float(w.a.sum()) + float(w.b.sum()) for w in weights.modules.values()) != 0.0)
"""
    root = Path(__file__).resolve().parents[2]
    run = [sys.executable, "-c", code]
    result = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=root)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr[-2000:]


def test_a_file_truncated_while_it_is_read_never_ends_the_process(adapter_copy: Path) -> None:
    """The file rewritten in place (truncated) in the middle of loading it: read whole, never mapped, the
    load finishes with what it read; mapped, the next tensor read ended the process with SIGBUS."""
    import subprocess
    import sys

    code = f"""
import torch
from pathlib import Path
import adapters.weights as weights_module
from adapters.spec import AdapterSpec
path = Path({str(adapter_copy)!r})
spec = AdapterSpec.from_dir(path)
parse = weights_module.parse_lora_key
def truncating(key):
    (path / {WEIGHTS_FILE!r}).write_bytes(b"broken")  # as a replacement written in place would
    return parse(key)
weights_module.parse_lora_key = truncating
weights = weights_module.load_adapter_weights(path, spec, dtype=torch.float32)
print(len(weights.modules) > 0)
"""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert result.returncode == 0 and result.stdout.strip() == "True", (
        result.returncode,
        result.stderr[-2000:],
    )
