"""Model fixtures (a pytest plugin): tiny random-init models of each demo architecture, with demo adapters."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from adapters.demo_adapters import DEMO_ADAPTERS, build_demo_adapters
from adapters.ref import AdapterRef
from adapters.store import AdapterStore
from app.modelprep.demo_model import Arch, build_model


@dataclass(frozen=True)
class TinySetup:
    arch: str
    model_dir: Path
    store_root: Path
    adapter_dirs: dict[str, Path]  # demo adapter name -> PEFT directory
    refs: dict[str, AdapterRef]  # demo adapter name -> ref in the store


class _TinySetups(dict[str, TinySetup]):
    """Builds an architecture's setup the first time a test asks for it (only some tests need Qwen3/Gemma)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, arch: Arch) -> TinySetup:
        root = self.factory.mktemp(f"tiny-{arch}")
        model_dir = build_model(root / "model", arch=arch, preset="tiny")
        adapter_dirs = build_demo_adapters(model_dir, root / "adapters")
        store = AdapterStore(root / "store")
        refs = {name: store.put_dir(name, path) for name, path in adapter_dirs.items()}
        setup = self[arch] = TinySetup(arch, model_dir, root / "store", adapter_dirs, refs)
        return setup


@pytest.fixture(scope="session")
def tiny_setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinySetup]:
    assert len(DEMO_ADAPTERS) >= 4
    return _TinySetups(tmp_path_factory)


@pytest.fixture(scope="session")
def llama(tiny_setups: dict[str, TinySetup]) -> TinySetup:
    return tiny_setups["llama"]
