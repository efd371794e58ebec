"""The batch runner (issue 37, items 3-5) through the official OpenAI SDK over the in-process app and a real
engine: batches of each endpoint run to `completed` with an output file keyed by custom_id, a line's own
failure in the error file, cancel mid-run, a runner stopped mid-batch whose lines another finishes (each
custom_id once, each line metered once), an engine that fails every line for a while (retried after waits,
billed once, for the run delivered), and a tenant out of money (insufficient_quota lines, no overspend)."""

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from openai import OpenAI
from sqlalchemy import func, select, update
from typer.testing import Result

from app.batches.finalize import line_id
from app.batches.lines import line_request_id
from app.batches.runner import BatchRunner
from app.metrics import MEMORY
from app.settings import BatchesConfig
from billing.models import Batch, UsageEvent, utcnow
from deployments.engine.interface import EngineRequest, EngineStopped, RequestOutput
from tests.app.conftest import Served, serving
from tests.app.helpers import wait_for
from tests.app.test_batches_api import create, lines_of, request_line
from tests.app.test_budgets_api import PRICES, cost_of, costs, top_up
from tests.app.test_files_api import client_for, jsonl, raw, upload
from tests.model_fixtures import TinySetup

FINAL = ("completed", "failed", "expired", "cancelled")
PER_TENANT = 2


@pytest.fixture(scope="module")
def served(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Short leases (a stopped runner's lines are claimed again within a second) and few lines in flight."""
    batches = BatchesConfig(
        lease_s=1.0,
        poll_interval_s=0.05,
        max_in_flight_per_tenant=PER_TENANT,
        retry_base_s=0.2,
        retry_max_s=0.8,
    )
    with serving(llama, tmp_path_factory.mktemp("runner"), batches=batches) as app:
        with app.admin() as admin:
            reply = admin.post("/admin/tiers", json={"name": "metered", "description": "priced", **PRICES})
            assert reply.status_code == 201, reply.text
        yield app


def finished(client: OpenAI, batch_id: str, timeout: float = 60) -> Any:
    deadline, wait = time.monotonic() + timeout, 0.05
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        time.sleep(wait)
        wait = min(0.5, wait * 1.2)  # within the tenant's reads a minute, however long the batch
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def file_lines(client: OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A result file's lines by custom_id (each custom_id at most once)."""
    if file_id is None:
        return {}
    lines = [json.loads(raw) for raw in client.files.content(file_id).content.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id twice"
    return by_id


def usage_rows(served: Served, request_ids: list[str]) -> dict[str, int]:
    with served.services.session_factory() as s:
        query = select(UsageEvent.request_id, func.count()).where(UsageEvent.request_id.in_(request_ids))
        return {rid: n for rid, n in s.execute(query.group_by(UsageEvent.request_id)).tuples()}


OBJECTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
           "/v1/responses": "response"}  # fmt: skip
TOO_LONG = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
            "/v1/responses": "max_output_tokens"}  # fmt: skip


@pytest.mark.parametrize("endpoint", list(OBJECTS))
def test_a_batch_runs_to_an_output_file_keyed_by_custom_id_and_a_bad_line_to_the_error_file(
    served: Served, endpoint: str
) -> None:
    _, client = client_for(served)
    good = [request_line(endpoint, f"ok-{i}", temperature=0) for i in range(3)]
    too_long: dict[str, Any] = {TOO_LONG[endpoint]: 10**6}  # valid for the schema, too long to run
    bad = request_line(endpoint, "too-long", **too_long)
    batch = create(client, upload(client, jsonl([*good, bad])).id, endpoint)
    done = finished(client, batch.id)
    assert done.status == "completed" and done.completed_at is not None and done.finalizing_at is not None
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert sorted(output) == ["ok-0", "ok-1", "ok-2"] and list(errors) == ["too-long"]
    for custom_id, line in output.items():
        request_id = line_request_id(batch.id, custom_id)
        assert line["id"] == line_id(request_id) and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"] == request_id
        assert response["body"]["object"] == OBJECTS[endpoint] and response["body"]["usage"]
    assert client.files.retrieve(done.output_file_id or "").purpose == "batch_output"
    failure = errors["too-long"]
    assert failure["error"] is None and failure["response"]["status_code"] == 400
    assert failure["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert failure["response"]["body"]["error"]["param"] == TOO_LONG[endpoint]
    ran = [line_request_id(batch.id, f"ok-{i}") for i in range(3)]
    wait_for(lambda: usage_rows(served, ran) == dict.fromkeys(ran, 1), timeout=10)
    assert usage_rows(served, [line_request_id(batch.id, "too-long")]) == {}  # refused before the engine
    with served.services.session_factory() as s:
        marked = s.scalars(select(UsageEvent.batch_id).where(UsageEvent.request_id.in_(ran)))
        assert list(marked) == [batch.id] * 3  # each line's usage row names its batch


def _slow_batch(client: OpenAI, lines: int) -> Any:
    requests = [
        request_line("/v1/completions", f"line-{i}", max_tokens=24, temperature=0) for i in range(lines)
    ]
    return create(client, upload(client, jsonl(requests)).id, "/v1/completions")


def test_cancel_mid_run_finishes_what_runs_and_never_runs_the_rest(served: Served) -> None:
    _, client = client_for(served)
    batch = _slow_batch(client, 12)
    wait_for(lambda: any(row.state == "done" for row in lines_of(served, batch.id)), timeout=30)
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert all(row.state != "queued" for row in lines_of(served, batch.id))  # dropped at once
    done = finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    rows = lines_of(served, batch.id)
    ran = [row for row in rows if row.state == "done"]
    assert 1 <= len(ran) < 12 and all(row.state == "done" for row in rows)
    assert sorted(file_lines(client, done.output_file_id)) == sorted(row.custom_id for row in ran)
    assert done.request_counts is not None and done.request_counts.completed == len(ran)
    assert done.request_counts.total == 12
    wait_for(lambda: len(usage_rows(served, [row.request_id for row in ran])) == len(ran), timeout=10)
    never = {f"line-{i}" for i in range(12)} - {row.custom_id for row in ran}
    assert usage_rows(served, [line_request_id(batch.id, custom_id) for custom_id in never]) == {}


def test_past_its_window_a_batch_expires_with_what_completed_delivered(served: Served) -> None:
    _, client = client_for(served)
    batch = _slow_batch(client, 10)
    wait_for(lambda: any(row.state == "done" for row in lines_of(served, batch.id)), timeout=30)
    with served.services.session_factory() as s, s.begin():
        s.execute(
            update(Batch).where(Batch.id == batch.id).values(expires_at=utcnow() - timedelta(seconds=1))
        )
    done = finished(client, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert sorted([*output, *errors]) == sorted(f"line-{i}" for i in range(10)) and output and errors
    assert all(
        line["error"]["code"] == "batch_expired" and line["response"] is None for line in errors.values()
    )
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (len(output), len(errors))
    ran = [line["response"]["request_id"] for line in output.values()]
    wait_for(lambda: len(usage_rows(served, ran)) == len(ran), timeout=10)  # what completed is charged


def _on_loop(runner: BatchRunner, work: Any) -> Any:
    assert runner.loop is not None
    return asyncio.run_coroutine_threadsafe(work, runner.loop).result(timeout=30)


def test_a_stopped_runners_lines_are_finished_by_another_each_once_and_metered_once(served: Served) -> None:
    _, client = client_for(served)
    runner: BatchRunner = served.app.state.batch_runner
    batch = _slow_batch(client, 6)
    wait_for(
        lambda: sum(row.state == "running" for row in lines_of(served, batch.id)) == PER_TENANT, timeout=30
    )
    _on_loop(runner, runner.stop())  # as if its replica died: its lines stay running under its lease
    abandoned = [row for row in lines_of(served, batch.id) if row.state == "running"]
    assert abandoned and all(row.lease_owner == runner.owner for row in abandoned)
    successor = BatchRunner(served.services)

    async def start() -> None:
        successor.start()

    _on_loop(runner, start())
    served.app.state.batch_runner = successor  # the app's lifespan stops it
    done = finished(client, batch.id)
    assert done.status == "completed"
    output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert sorted([*output, *errors]) == sorted(f"line-{i}" for i in range(6)) and not errors
    rows = lines_of(served, batch.id)
    retried = {row.custom_id for row in rows if row.attempts > 1}
    assert {row.custom_id for row in abandoned} <= retried
    ids = [row.request_id for row in rows]
    wait_for(lambda: usage_rows(served, ids) == dict.fromkeys(ids, 1), timeout=10)
    with served.services.session_factory() as s:
        metered = {
            rid: n for rid, n in s.execute(select(UsageEvent.request_id, UsageEvent.completion_tokens))
        }
    for line in output.values():  # the run delivered is the one billed
        response = line["response"]
        assert metered[response["request_id"]] == response["body"]["usage"]["completion_tokens"]


class _LostEngine:
    """The engine client, except that until `until` each batch-class request fails after its first token or
    before its end, as when the engine replica running it is lost (the engine accepted it and ran some of
    it)."""

    def __init__(self, inner: Any, until: float) -> None:
        self.inner, self.until, self.failed = inner, until, 0

    def generate(self, base_model: str, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        outputs = self.inner.generate(base_model, request)
        if request.priority != "batch" or time.monotonic() >= self.until:
            return outputs  # type: ignore[no-any-return]
        self.failed += 1
        return self._fails_after_a_token(outputs)

    @staticmethod
    async def _fails_after_a_token(
        outputs: AsyncGenerator[RequestOutput, None],
    ) -> AsyncGenerator[RequestOutput, None]:
        try:
            async for out in outputs:
                if out.finished:  # lost before its end (a line answered whole has one output with tokens)
                    break
                yield out
                if out.token_ids:
                    break
        finally:
            await outputs.aclose()
        raise EngineStopped("the replica running it was lost")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_lines_an_engine_fails_for_a_while_are_retried_after_waits_and_billed_once_for_the_run_delivered(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every try fails for 1.5 s (an engine replica restarting): the lines wait between tries (0.2 s
    doubling, not at once: three immediate tries would have spent their attempts), none reaches the error
    file, and each is billed once, for the run that answered it (a failed try's usage row would have taken
    its request id first)."""
    _, client = client_for(served)
    lost = _LostEngine(served.services.engine, time.monotonic() + 1.5)
    monkeypatch.setattr(served.services, "engine", lost)
    batch = _slow_batch(client, 4)
    done = finished(client, batch.id)
    assert done.status == "completed" and lost.failed >= 4
    output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert sorted(output) == [f"line-{i}" for i in range(4)] and not errors
    rows = lines_of(served, batch.id)
    assert all(2 <= row.attempts < BatchesConfig().max_attempts for row in rows)
    ids = [row.request_id for row in rows]
    wait_for(lambda: usage_rows(served, ids) == dict.fromkeys(ids, 1), timeout=10)
    with served.services.session_factory() as s:
        billed = {
            rid: (status, tokens)
            for rid, status, tokens in s.execute(
                select(UsageEvent.request_id, UsageEvent.status, UsageEvent.completion_tokens).where(
                    UsageEvent.request_id.in_(ids)
                )
            )
        }
    for line in output.values():
        response = line["response"]
        usage = response["body"]["usage"]["completion_tokens"]
        assert billed[response["request_id"]] == ("completed", usage) and usage == 24


def test_a_line_the_platform_fails_every_time_goes_to_the_error_file_and_frees_its_money_at_once(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its attempts a line's last failure is its answer, unbilled, and the hold its last try kept for
    a retry is freed then, not left reserved until it lapses (two minutes of the tenant's credit)."""
    tenant_id, client = client_for(served, tier="metered")
    assert top_up(served, tenant_id, "5").status_code == 201
    lost = _LostEngine(served.services.engine, time.monotonic() + 3600)  # every try, all the test long
    monkeypatch.setattr(served.services, "engine", lost)
    batch = _slow_batch(client, 2)
    done = finished(client, batch.id)
    assert done.status == "completed" and not file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    assert sorted(errors) == ["line-0", "line-1"]
    assert all(line["response"]["status_code"] == 503 for line in errors.values())
    assert all(row.attempts == BatchesConfig().max_attempts for row in lines_of(served, batch.id))
    budget = raw(client, "GET", "limits").json()["budget"]
    assert Decimal(budget["reserved"]) == 0 and Decimal(budget["balance"]) == 5
    assert usage_rows(served, [line_request_id(batch.id, f"line-{i}") for i in range(2)]) == {}


def test_batch_line_metrics_follow_each_tenants_lines_queued_running_and_ended(served: Served) -> None:
    tenant_id, client = client_for(served)
    tenant = {"tenant": tenant_id}
    lines = [request_line("/v1/completions", f"line-{i}", max_tokens=24, temperature=0) for i in range(5)]
    bad = request_line("/v1/completions", "too-long", max_tokens=10**6)  # fails: the error file
    batch = create(client, upload(client, jsonl([*lines, bad])).id, "/v1/completions")
    wait_for(
        lambda: (
            MEMORY.value("loraplex_batch_lines_running", **tenant) == PER_TENANT
            and MEMORY.value("loraplex_batch_lines_queued", **tenant) > 0
        ),
        timeout=30,
    )  # the tenant's share in flight, the rest waiting
    assert finished(client, batch.id).status == "completed"
    assert MEMORY.value("loraplex_batch_lines_claimed", **tenant) == 6  # each once: nothing failed to run
    assert MEMORY.value("loraplex_batch_lines_ended", **tenant, outcome="done") == 5
    assert MEMORY.value("loraplex_batch_lines_ended", **tenant, outcome="failed") == 1
    assert MEMORY.value("loraplex_batch_lines_ended", **tenant, outcome="requeued") == 0
    wait_for(
        lambda: (
            MEMORY.value("loraplex_batch_lines_running", **tenant) == 0
            and MEMORY.value("loraplex_batch_lines_queued", **tenant) == 0
        )
    )  # back to 0, not left at the last value


def test_a_tenant_out_of_money_gets_insufficient_quota_lines_and_nothing_overspent(served: Served) -> None:
    tenant_id, client = client_for(served, tier="metered")
    assert top_up(served, tenant_id, "0.1").status_code == 201  # room for about two lines' holds
    batch = _slow_batch(client, 8)
    done = finished(client, batch.id)
    assert done.status == "completed"
    output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert output and errors and len(output) + len(errors) == 8
    for line in errors.values():
        assert line["response"]["status_code"] == 429
        assert line["response"]["body"]["error"]["code"] == "insufficient_quota"
    ids = [line["response"]["request_id"] for line in output.values()]
    wait_for(lambda: len(usage_rows(served, ids)) == len(ids), timeout=10)
    with served.services.session_factory() as s:
        spent = s.scalar(select(func.sum(UsageEvent.cost)).where(UsageEvent.tenant_id == tenant_id))
    assert Decimal(str(spent)) <= Decimal("0.1")
    assert sum(row.state == "done" for row in lines_of(served, batch.id)) == len(output)


def test_a_batch_line_costs_its_tiers_batch_price_factor_times_the_interactive_price(served: Served) -> None:
    with served.admin() as admin:
        assert admin.get("/admin/tiers/metered").json()["batch_price_factor"] == "0.5000"  # the default
        reply = admin.patch("/admin/tiers/metered", json={"batch_price_factor": "0.25"})
        assert reply.status_code == 200, reply.text
        assert admin.patch("/admin/tiers/metered", json={"batch_price_factor": "1.5"}).status_code == 400
    try:
        tenant_id, client = client_for(served, tier="metered")
        assert top_up(served, tenant_id, "10").status_code == 201
        url = "/v1/completions"
        batch = create(client, upload(client, jsonl([request_line(url, "one", max_tokens=8)])).id, url)
        done = finished(client, batch.id)
        body = file_lines(client, done.output_file_id)["one"]["response"]["body"]
        wait_for(lambda: usage_rows(served, [line_request_id(batch.id, "one")]) != {}, timeout=10)
        assert costs(served, tenant_id) == [(cost_of(body) * Decimal("0.25")).quantize(Decimal("0.000001"))]
    finally:
        with served.admin() as admin:
            admin.patch("/admin/tiers/metered", json={"batch_price_factor": "0.5"})


def test_batch_lines_carry_the_batch_engine_class(served: Served) -> None:
    """Lines enter the engine as `batch` requests (outside the interactive class's rows)."""
    seen: list[str] = []
    engine = served.engine
    original = engine.generate

    def spy(request: Any) -> Any:  # the real engine runs it; only its class is noted
        seen.append(request.priority)
        return original(request)

    engine.generate = spy  # type: ignore[method-assign]
    try:
        _, client = client_for(served)
        batch = create(
            client, upload(client, jsonl([request_line("/v1/completions", "one")])).id, "/v1/completions"
        )
        assert finished(client, batch.id).status == "completed"
    finally:
        engine.generate = original  # type: ignore[method-assign]
    assert seen == ["batch"]


def test_the_cli_lists_and_cancels_batches(served: Served, cli: Callable[..., Result]) -> None:
    tenant_id, client = client_for(served)
    batch = _slow_batch(client, 12)
    listed = json.loads(cli("--json", "batches", "list", "--tenant", tenant_id).stdout)
    assert [(b["id"], b["tenant_id"]) for b in listed["data"]] == [(batch.id, tenant_id)]
    human = cli("batches", "list", "--tenant", tenant_id)
    assert human.exit_code == 0 and batch.id in human.stdout
    cancelled = cli("--json", "batches", "cancel", batch.id)
    assert cancelled.exit_code == 0, cancelled.stdout
    assert json.loads(cancelled.stdout)["status"] in ("cancelling", "cancelled")
    assert finished(client, batch.id).status == "cancelled"
    assert cli("batches", "cancel", "batch_nosuch").exit_code != 0
