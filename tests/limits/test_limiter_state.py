"""LimiterState on an injected clock: the exact algorithm every backend follows, to the millisecond."""

from collections import OrderedDict

import pytest

from app.limits import WINDOW_MS, Decision, InvalidTokenCount, Limits, format_duration
from app.limits.state import CONCURRENCY_RETRY_MS, QUEUE_STALE_MS, LimiterState, _Tenant

T = "acme"


def admit(
    state: LimiterState, request_id: str, limits: Limits, now: int, reserve: int = 0, *, queued: bool = False
) -> Decision:
    return state.admit(T, request_id, limits, reserve, queued=queued, now=now)


def test_request_window_slides_to_the_millisecond() -> None:
    state, limits = LimiterState(), Limits(rpm=2)
    assert admit(state, "a", limits, 0).admitted
    assert admit(state, "b", limits, 10).admitted
    denied = admit(state, "c", limits, 100)
    assert denied.reason == "requests" and denied.retry_after_ms == 59_900  # "a" leaves at 60 000
    assert denied.reset_requests_ms == 59_910 and denied.remaining_requests == 0  # "b" leaves at 60 010
    assert admit(state, "c", limits, 59_999).retry_after_ms == 1
    freed = admit(state, "c", limits, WINDOW_MS)  # admitted at 0: its slot is free at 60 000 exactly
    assert freed.admitted and freed.remaining_requests == 0 and freed.reset_requests_ms == WINDOW_MS
    assert admit(state, "d", limits, 60_009).retry_after_ms == 1
    assert admit(state, "d", limits, 60_010).admitted


def test_token_window_expires_reservations_in_order() -> None:
    state, limits = LimiterState(), Limits(tpm=1000)
    assert admit(state, "a", limits, 0, 600).remaining_tokens == 400
    assert admit(state, "b", limits, 1_000, 300).remaining_tokens == 100
    denied = admit(state, "c", limits, 30_000, 500)
    assert denied.reason == "tokens" and denied.retry_after_ms == 30_000  # once "a" leaves
    assert denied.reset_tokens_ms == 31_000 and denied.remaining_tokens == 100
    assert admit(state, "c", limits, 30_000, 900).retry_after_ms == 31_000  # once "b" leaves too
    assert admit(state, "c", limits, 59_999, 500).retry_after_ms == 1
    admitted = admit(state, "c", limits, WINDOW_MS, 500)
    assert admitted.admitted and admitted.remaining_tokens == 200
    assert admit(state, "d", limits, 61_000).remaining_tokens == 500  # "b" is out


def test_released_reservation_leaves_the_window_with_what_was_used() -> None:
    state, limits = LimiterState(), Limits(tpm=1000)
    admit(state, "a", limits, 0, 600)
    state.release(T, "a", 100)
    assert admit(state, "b", limits, 30_000, 900).remaining_tokens == 0
    assert admit(state, "probe", limits, WINDOW_MS).remaining_tokens == 100  # "a"'s 100 left, not 600


def test_release_after_the_window_changes_nothing() -> None:
    state, limits = LimiterState(), Limits(tpm=1000)
    admit(state, "a", limits, 0, 500)
    assert admit(state, "probe", limits, WINDOW_MS).remaining_tokens == 1000
    state.release(T, "a", 10)
    assert admit(state, "probe2", limits, WINDOW_MS + 1).remaining_tokens == 1000


def test_token_wait() -> None:
    tenant = _Tenant(tokens=OrderedDict(a=(0, 600), b=(1_000, 300)), token_total=900)
    assert LimiterState._token_wait(tenant, 500, 30_000) == 30_000  # "a" leaving is enough
    assert LimiterState._token_wait(tenant, 100, 30_000) == 31_000  # both must leave
    assert LimiterState._token_wait(tenant, 0, 30_000) == 31_000
    assert LimiterState._token_wait(tenant, -1, 30_000) == WINDOW_MS  # never fits: try again in a minute
    assert LimiterState._token_wait(tenant, 500, WINDOW_MS) == 1  # never 0 for a denial


def test_lease_expires_at_its_ttl_exactly() -> None:
    state, limits = LimiterState(), Limits(max_concurrent=1, lease_ttl_ms=1_000)
    assert admit(state, "a", limits, 0).admitted
    denied = admit(state, "b", limits, 999)
    assert denied.reason == "concurrency" and denied.retry_after_ms == CONCURRENCY_RETRY_MS
    assert admit(state, "b", limits, 1_000).admitted


def test_renew_moves_the_expiry_from_now() -> None:
    state, limits = LimiterState(), Limits(max_concurrent=1, lease_ttl_ms=1_000)
    assert admit(state, "a", limits, 0).admitted
    state.renew(T, "a", 1_000, now=900)
    assert admit(state, "b", limits, 1_899).reason == "concurrency"
    assert admit(state, "b", limits, 1_900).admitted


def test_silent_waiter_goes_stale_exactly() -> None:
    state, limits = LimiterState(), Limits(max_concurrent=1, on_limit="queue")
    assert admit(state, "holder", limits, 0).admitted
    assert admit(state, "silent", limits, 0, queued=True).reason == "concurrency"
    assert admit(state, "patient", limits, 10, queued=True).reason == "queued"
    state.release(T, "holder", 0)
    assert admit(state, "patient", limits, QUEUE_STALE_MS - 1, queued=True).reason == "queued"
    assert admit(state, "patient", limits, QUEUE_STALE_MS, queued=True).admitted


def test_polling_keeps_a_waiters_place() -> None:
    state, limits = LimiterState(), Limits(max_concurrent=1, on_limit="queue")
    assert admit(state, "holder", limits, 0).admitted
    admit(state, "first", limits, 0, queued=True)
    admit(state, "second", limits, 10, queued=True)
    assert admit(state, "first", limits, 1_500, queued=True).reason == "concurrency"
    state.release(T, "holder", 0)
    assert admit(state, "second", limits, 3_000, queued=True).reason == "queued"  # "first" polled at 1 500
    assert admit(state, "first", limits, 3_000, queued=True).admitted


def test_readmitted_id_does_not_leak_tokens() -> None:
    state, limits = LimiterState(), Limits(tpm=1000)
    admit(state, "dup", limits, 0, 400)
    admit(state, "dup", limits, 1, 400)
    assert admit(state, "probe", limits, 2 * WINDOW_MS).remaining_tokens == 1000  # everything has left


# --- headers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (-5, "0ms"),
        (0, "0ms"),
        (12, "12ms"),
        (999, "999ms"),
        (1_000, "1s"),
        (1_500, "1.5s"),
        (59_999, "59.999s"),
        (60_000, "1m0s"),
        (90_500, "1m30.5s"),
        (360_000, "6m0s"),
        (3_599_999, "59m59.999s"),
    ],
)
def test_format_duration(ms: int, text: str) -> None:
    assert format_duration(ms) == text


def test_headers_from_a_denial() -> None:
    state, limits = LimiterState(), Limits(rpm=1, tpm=1000)
    admit(state, "a", limits, 0, 300)
    denied = admit(state, "b", limits, 12_345, 300)
    assert denied.headers() == {
        "x-ratelimit-limit-requests": "1",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "47.655s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "700",
        "x-ratelimit-reset-tokens": "47.655s",
    }


def test_headers_only_for_the_limits_that_are_set() -> None:
    requests_only = Decision(True, None, 0, 10, -2, 12, None, None, 0)
    assert requests_only.headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "0",  # limit lowered under a full window: never negative
        "x-ratelimit-reset-requests": "12ms",
    }
    tokens_only = Decision(False, "tokens", 90_500, None, None, 0, 5000, 4000, 90_500)
    assert tokens_only.headers() == {
        "x-ratelimit-limit-tokens": "5000",
        "x-ratelimit-remaining-tokens": "4000",
        "x-ratelimit-reset-tokens": "1m30.5s",
    }
    assert Decision(True, None, 0, None, None, 0, None, None, 0).headers() == {}


def test_waiters_past_the_cap_get_queue_full_and_leave_no_trace() -> None:
    state, limits = LimiterState(), Limits(rpm=1, on_limit="queue")
    assert admit(state, "first", limits, 0).admitted

    def wait(request_id: str, now: int) -> Decision:
        return state.admit(T, request_id, limits, 0, queued=True, max_waiters=2, now=now)

    assert wait("w1", 10).reason == "requests"
    assert wait("w2", 20).reason == "queued"
    full = wait("w3", 30)
    assert full.reason == "queue_full" and full.retry_after_ms == WINDOW_MS - 30  # the limit in the way
    assert state.queue_order(T) == ["w1", "w2"]
    assert wait("w2", 40).reason == "queued"  # one already waiting keeps its place
    state.leave_queue(T, "w1")
    assert wait("w3", 50).reason == "queued"  # a place came free


@pytest.mark.parametrize("bad", [10**20, -1, float("inf"), float("nan"), 1.5, True, "5", None])
def test_token_counts_are_checked_before_anything_changes(bad: object) -> None:
    state, limits = LimiterState(), Limits(rpm=5)
    with pytest.raises(InvalidTokenCount):
        state.admit(T, "bad", limits, bad, queued=False, now=0)  # type: ignore[arg-type]
    assert T not in state._tenants  # not even an empty entry
    assert admit(state, "held", limits, 0, reserve=100).admitted
    with pytest.raises(InvalidTokenCount):
        state.release(T, "held", bad)  # type: ignore[arg-type]
    peeked = state.peek(T, now=1)
    assert (peeked.requests, peeked.tokens, peeked.in_flight) == (1, 100, 1)
    assert admit(state, "whole-float", limits, 2, reserve=100.0).admitted  # type: ignore[arg-type]
