"""CI detection: any truthy CI value makes the mandatory tests mandatory."""

import pytest

from tests.ci import is_ci


@pytest.mark.parametrize("value", ["true", "True", "1", "yes", "on", "github-actions"])
def test_truthy_ci_values_count(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", value)
    assert is_ci()


@pytest.mark.parametrize("value", ["", "0", "false", "FALSE", "no", "off"])
def test_false_or_missing_ci_does_not(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", value)
    assert not is_ci()
    monkeypatch.delenv("CI")
    assert not is_ci()
