"""A served engine's forward leaves a core to its process's other work (EngineConfig.cpu_threads)."""

import os

import pytest
import torch

from deployments.engine.cpu_features import engine_threads
from tests.engine.helpers import running, tiny_config
from tests.model_fixtures import TinySetup


@pytest.mark.parametrize(("cores", "want"), [({0}, 1), ({0, 1}, 1), ({0, 1, 2, 3}, 3)])
def test_the_default_is_the_cores_this_process_may_use_less_one(
    cores: set[int], want: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: cores)
    assert engine_threads(None) == want
    assert engine_threads(5) == 5  # a configured count is taken as it is


def test_a_served_engine_sets_its_processs_threads(llama: TinySetup) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with running(tiny_config(llama, cpu_threads=1)):
            assert torch.get_num_threads() == 1
        with running(tiny_config(llama, cpu_threads=2)):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_count_below_one_is_refused(llama: TinySetup) -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        tiny_config(llama, cpu_threads=0)
