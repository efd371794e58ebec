"""The background retry of a settle or a lease release that failed on the request's path: it lands once
the backend is back, and gives up at its deadline."""

import logging

import pytest

from app import background_retry


class Flaky:
    """A backend call that fails its first `failures` calls."""

    def __init__(self, failures: int) -> None:
        self.left = failures
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.left:
            self.left -= 1
            raise ConnectionError("the backend is away")


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background_retry, "FIRST_WAIT_S", 0.01)


async def test_a_retry_lands_once_the_backend_is_back() -> None:
    call = Flaky(failures=3)
    retry = background_retry.retry_in_background(
        call, what="settling req_1", within_s=5.0, max_wait_s=0.05, gave_up="lost"
    )
    assert retry in background_retry.RUNNING  # kept alive while it runs
    assert await retry is True
    assert call.calls == 4 and retry not in background_retry.RUNNING


async def test_a_retry_gives_up_at_its_deadline_and_says_what_is_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    call = Flaky(failures=10_000)
    with caplog.at_level(logging.WARNING, logger=background_retry.__name__):
        retry = background_retry.retry_in_background(
            call,
            what="releasing req_2",
            within_s=0.3,
            max_wait_s=0.02,
            gave_up="its lease has expired by now",
            gave_up_level=logging.ERROR,
        )
        assert await retry is False
    assert 5 < call.calls < 40  # backed off to max_wait_s, stopped at the deadline
    gave_up = [r for r in caplog.records if r.message.startswith("gave up releasing req_2")]
    assert len(gave_up) == 1 and gave_up[0].levelno == logging.ERROR
    assert "its lease has expired by now" in gave_up[0].message
