"""Locust users for loraplex: several tenants (one on a tight tier, so some 429s are intended), the base
model and public demo adapters, /v1/chat/completions and /v1/completions, streamed and not, small
max_tokens. Every request's outcome is kept in RECORDER (per tenant: 200s, 429s, 503s, other), with the
request id and usage the platform answered, so a runner can hold the billing database to it.

The plan (tenants and their keys, models) is a JSON file named by LORAPLEX_BENCH_PLAN:
    {"tenants": [{"name": "ent", "tenant_id": "ten_...", "key": "sk-lp-...", "users": 3,
                  "limited": false}, ...],
     "models": ["demo-llama", "public/demo-sql", ...], "max_tokens": [2, 12]}
Run: python -m bench.load_test --duration 300 (it writes the plan and drives these users in-process), or
standalone: LORAPLEX_BENCH_PLAN=plan.json locust -f bench/locustfile.py --headless -u 8 -t 5m
--host http://127.0.0.1:8000
"""

import itertools
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from locust import between, task
from locust.contrib.fasthttp import FastHttpUser
from locust.exception import StopUser

Kind = Literal["chat", "completion"]
# What became of one request, as the client saw it.
Outcome = Literal[
    "ok",  # 200, complete (a stream ended with [DONE])
    "rate_limited",  # 429 rate_limit_exceeded for a tenant whose tier has limits: intended
    "unavailable",  # 503 with an OpenAI error body: the platform said "not now"
    "stream_error",  # 200, then an error event in the stream (its engine replica died mid-stream)
    "truncated",  # 200, then the stream ended without [DONE] or an error event
    "transport",  # no HTTP answer: refused, reset, timed out
    "other",  # anything else (a 429 for an unlimited tenant, 4xx, 500, ...)
]


@dataclass
class Result:
    tenant: str
    kind: Kind
    stream: bool
    model: str
    status: int  # 0: no HTTP answer
    outcome: Outcome
    started: float  # epoch seconds
    ended: float
    request_id: str | None = None  # ours (req_...): the usage row's key; known for 200s
    usage: tuple[int, int] | None = None  # (prompt, completion) as the response reported it
    error_code: str | None = None
    detail: str = ""

    @property
    def latency_ms(self) -> float:
        return (self.ended - self.started) * 1e3


@dataclass
class Tenant:
    name: str
    tenant_id: str
    key: str
    users: int = 1
    limited: bool = True  # has a limit that may refuse it: its 429s are intended


@dataclass
class Plan:
    tenants: list[Tenant]
    models: list[str]
    max_tokens: tuple[int, int] = (2, 12)

    @classmethod
    def load(cls, path: Path) -> "Plan":
        data: dict[str, Any] = json.loads(path.read_text())
        low, high = data.get("max_tokens", (2, 12))
        return cls([Tenant(**t) for t in data["tenants"]], list(data["models"]), (int(low), int(high)))


@dataclass
class Recorder:
    """Shared by every user (greenlets on one thread: no locking needed)."""

    results: list[Result] = field(default_factory=list)
    in_flight: int = 0
    stopping: bool = False  # set by the runner: users finish what they are doing and start nothing new

    def counts(self) -> dict[str, Counter[str]]:
        """tenant -> outcome -> n; 'status:<code>' entries count HTTP statuses."""
        out: dict[str, Counter[str]] = {}
        for r in self.results:
            tenant = out.setdefault(r.tenant, Counter())
            tenant[r.outcome] += 1
            tenant[f"status:{r.status}"] += 1
        return out


RECORDER = Recorder()
_plan: Plan | None = None
_assignments: "itertools.cycle[Tenant] | None" = None


def plan() -> Plan:
    global _plan, _assignments
    if _plan is None:
        source = os.environ.get("LORAPLEX_BENCH_PLAN")
        if not source:
            raise RuntimeError("LORAPLEX_BENCH_PLAN must name the plan JSON file (see bench/locustfile.py)")
        _plan = Plan.load(Path(source))
        # Users take tenants in turn, each tenant as many times as its `users`.
        _assignments = itertools.cycle([t for t in _plan.tenants for _ in range(max(1, t.users))])
    return _plan


def next_tenant() -> Tenant:
    plan()
    assert _assignments is not None
    return next(_assignments)


def _prompt(rng: random.Random) -> str:
    words = ("select", "rows", "from", "the", "ledger", "where", "tenant", "poem", "about", "rain", "sea")
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))


class LoraplexUser(FastHttpUser):
    """One client of one tenant; a task is one request, chosen by weight."""

    wait_time = between(0.3, 1.5)
    network_timeout = 120.0  # between two reads: a stream stalls this long before we call it hung
    connection_timeout = 30.0
    max_retries = 0  # a retried POST would be a second request (and a second usage row)
    concurrency = 1

    def on_start(self) -> None:
        self.tenant = next_tenant()
        self.rng = random.Random()

    @task(3)
    def chat(self) -> None:
        self.call("chat", stream=False)

    @task(2)
    def chat_stream(self) -> None:
        self.call("chat", stream=True)

    @task(3)
    def completion(self) -> None:
        self.call("completion", stream=False)

    @task(2)
    def completion_stream(self) -> None:
        self.call("completion", stream=True)

    def call(self, kind: Kind, *, stream: bool) -> None:
        if RECORDER.stopping:
            raise StopUser()
        p = plan()
        model = self.rng.choice(p.models)
        body: dict[str, Any] = {"model": model, "max_tokens": self.rng.randint(*p.max_tokens)}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": _prompt(self.rng)}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = _prompt(self.rng)
            path = "/v1/completions"
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        headers = {"authorization": f"Bearer {self.tenant.key}"}
        name = f"{path} {'stream' if stream else 'json'}"
        result = Result(self.tenant.name, kind, stream, model, 0, "transport", time.time(), 0.0)
        RECORDER.in_flight += 1
        try:
            with self.client.post(
                path, json=body, headers=headers, stream=stream, catch_response=True, name=name
            ) as response:
                result.status = response.status_code
                if result.status == 200:
                    read = _read_stream(response) if stream else _read_json(response)
                    result.outcome, result.request_id, result.usage, result.detail = read
                else:
                    result.outcome, result.error_code = _refusal(response, self.tenant)
                    result.detail = (response.text or "")[:300] if result.outcome == "other" else ""
                if result.outcome in ("ok", "rate_limited"):
                    response.success()
                else:
                    response.failure(f"{result.outcome} {result.status} {result.error_code or ''}")
        except Exception as error:  # the response object itself failed: still a recorded outcome
            result.outcome = "other" if result.status else "transport"
            result.detail = f"{type(error).__name__}: {error}"[:300]
        finally:
            result.ended = time.time()
            RECORDER.in_flight -= 1
            RECORDER.results.append(result)


def _read_json(response: Any) -> tuple[Outcome, str | None, tuple[int, int] | None, str]:
    try:
        data = response.json()
    except ValueError:
        return "other", None, None, (response.text or "")[:300]
    usage = data.get("usage") or {}
    counts = (int(usage.get("prompt_tokens", -1)), int(usage.get("completion_tokens", -1)))
    return "ok", data.get("id"), counts, ""


def _read_stream(response: Any) -> tuple[Outcome, str | None, tuple[int, int] | None, str]:
    """Server-sent events to the end: the id (first event), the usage chunk, and how the stream ended."""
    request_id: str | None = None
    usage: tuple[int, int] | None = None
    buffer = ""
    done = False
    for chunk in response.iter_content(chunk_size=4096, decode_content=True):
        buffer += chunk if isinstance(chunk, str) else chunk.decode("utf-8", "replace")
        while "\n" in buffer:
            line, buffer = buffer.split("\n", 1)
            if not line.startswith("data: "):
                continue
            payload = line[6:].strip()
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                return "stream_error", request_id, None, json.dumps(event["error"])[:300]
            request_id = request_id or event.get("id")
            if event.get("usage"):
                usage = (int(event["usage"]["prompt_tokens"]), int(event["usage"]["completion_tokens"]))
    if not done:
        return "truncated", request_id, usage, buffer[:300]
    return "ok", request_id, usage, ""


def _refusal(response: Any, tenant: Tenant) -> tuple[Outcome, str | None]:
    try:
        code = (response.json().get("error") or {}).get("code")
    except (ValueError, TypeError, AttributeError):
        code = None
    if response.status_code == 429 and code == "rate_limit_exceeded" and tenant.limited:
        return "rate_limited", code
    if response.status_code == 503 and code is not None:
        return "unavailable", code
    if response.status_code == 0:
        return "transport", None
    return "other", code
