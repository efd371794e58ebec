"""End to end on Ray Serve: OpenAI SDK and raw HTTP against two base models served side by side."""

import json
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import NotFoundError, OpenAI
from openai.types.chat import ChatCompletionMessageParam
from sqlalchemy import select

from app.schemas.openai import ChatMessage
from app.served_models.prompts import PromptBuilder
from billing.models import UsageEvent
from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest, EngineStats
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.sampling_params import SamplingParams
from tests.app.conftest import ADMIN_KEY
from tests.e2e.conftest import ServeApp
from tests.engine.helpers import drain, text

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def key(serve_app: ServeApp) -> str:
    return serve_app.new_tenant("e2e-acme")[1]


@pytest.fixture(scope="module")
def client(serve_app: ServeApp, key: str) -> OpenAI:
    return OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize(("model", "arch"), [("tiny-llama", "llama"), ("tiny-qwen2", "qwen2")])
def test_chat_over_http_equals_the_engine(serve_app: ServeApp, client: OpenAI, model: str, arch: str) -> None:
    setup = serve_app.setups[arch]
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=16, temperature=0.7, seed=3
    )
    engine = LLMEngine(
        EngineConfig(model=setup.model_dir, dtype="float32", adapter_store=setup.store_root, num_kv_blocks=64)
    )
    prompt = PromptBuilder(setup.model_dir).chat([ChatMessage(**m) for m in MESSAGES])
    engine.add_request(EngineRequest("ref", prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=3)))
    assert reply.choices[0].message.content == text(drain(engine)["ref"])
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    engine.close()


def test_both_base_models_are_listed(client: OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert {"tiny-llama", "tiny-qwen2"} <= ids


def test_streaming_chat_and_completion_with_usage(client: OpenAI) -> None:
    whole = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    last_usage = chunks[-1].usage
    assert last_usage is not None and whole.usage is not None
    assert last_usage.total_tokens == whole.usage.total_tokens
    streamed = client.completions.create(
        model="tiny-qwen2", prompt="Once", max_tokens=8, temperature=0, stream=True
    )
    assert sum(1 for c in streamed if c.choices) >= 1


def test_unknown_model_is_a_404_in_openai_shape(client: OpenAI) -> None:
    with pytest.raises(NotFoundError) as error:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    body = error.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found"


def test_raw_http_errors_carry_request_ids(serve_app: ServeApp, key: str) -> None:
    unauthorized = httpx.post(f"{serve_app.url}/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"
    assert unauthorized.headers["x-request-id"]
    headers = {"authorization": f"Bearer {key}", "x-request-id": "my-trace-1"}
    bad = httpx.post(
        f"{serve_app.url}/v1/completions",
        headers=headers,
        json={"model": "tiny-llama", "prompt": "x", "temperature": 9},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert bad.headers["x-request-id"] == "my-trace-1"
    too_long = httpx.post(
        f"{serve_app.url}/v1/completions",
        headers=headers,
        json={"model": "tiny-llama", "prompt": [1] * 1100, "max_tokens": 4},
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def engine_stats(serve_app: ServeApp) -> EngineStats:
    stats: EngineStats = serve_app.engine_handle("tiny-llama").stats.remote().result()
    return stats


def wait_until_freed(serve_app: ServeApp, since: float, bound_s: float = 5.0) -> EngineStats:
    """The replica holds no sequence and no KV block; fails past `bound_s` after `since`."""
    while (stats := engine_stats(serve_app)).running or stats.waiting or stats.kv_usage:
        assert time.monotonic() - since < bound_s, f"the replica still holds work: {stats}"
        time.sleep(0.02)
    return stats


def test_client_disconnect_aborts_on_the_engine_replica(serve_app: ServeApp, key: str) -> None:
    max_tokens = 1000
    body = {"model": "tiny-llama", "prompt": "go", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    before = engine_stats(serve_app)
    with httpx.stream(
        "POST",
        f"{serve_app.url}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["choices"][0]["finish_reason"] is None
                seen += 1
            if seen == 3:
                break
    after = wait_until_freed(serve_app, time.monotonic())
    assert after.aborts == before.aborts + 1  # the replica aborted it; it did not run to the end unseen
    assert 3 <= after.generated_tokens - before.generated_tokens < max_tokens // 4
    # The ingress logs a client that left as one ordinary line; before: an ERROR with Serve's
    # TaskCancelledError traceback ("error after the response started").
    lines = ingress_log_lines(event["id"], "client disconnected")
    assert [line for line in lines if "client disconnected" in line and line.startswith("INFO")], lines
    assert not [line for line in lines if "ERROR" in line], lines


def ingress_log_lines(request_id: str, awaited: str, timeout: float = 30) -> list[str]:
    """The ingress replicas' log lines that carry `request_id`, once one of them contains `awaited`."""
    from ray.serve._private.logging_utils import get_serve_logs_dir

    logs = Path(get_serve_logs_dir())
    deadline = time.monotonic() + timeout
    while True:
        lines = [
            line
            for path in logs.glob("replica_*ingress*.log")
            for line in path.read_text(errors="replace").splitlines()
            if request_id in line
        ]
        if any(awaited in line for line in lines):
            return lines
        assert time.monotonic() < deadline, f"no {awaited!r} line for {request_id} in {logs}: {lines}"
        time.sleep(0.5)


def test_engine_replicas_hold_neither_the_admin_key_nor_the_key_secret(serve_app: ServeApp) -> None:
    """This one node's environment has both (the ingress needs them); its engine replicas have them blank."""
    engines, ingress = replica_processes(serve_app, "engine-"), replica_processes(serve_app, "ingress")
    assert len(engines) == 2 and len(ingress) == 1
    assert ingress[0].environ()["LORAPLEX_ADMIN_KEY"] == ADMIN_KEY
    for engine in engines:
        environ = engine.environ()
        assert environ["LORAPLEX_ADMIN_KEY"] == "" and environ.get("LORAPLEX_KEY_SECRET", "") == ""
        assert environ["LORAPLEX_DATABASE_URL"] == serve_app.database_url  # what it does need


def test_cancelling_through_the_serve_handle_aborts_on_the_replica(serve_app: ServeApp) -> None:
    """What the ingress does when its client leaves: cancel the streaming handle call."""
    max_tokens = 1000
    handle = serve_app.engine_handle("tiny-llama").options(stream=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    before = engine_stats(serve_app)
    stream = handle.generate.remote(EngineRequest(f"handle-{time.monotonic_ns()}", [5, 6, 7], params))
    received = [next(stream) for _ in range(3)]
    assert all(out.token_ids and not out.finished for out in received)
    stream.cancel()
    after = wait_until_freed(serve_app, time.monotonic())
    assert after.aborts == before.aborts + 1
    assert 3 <= after.generated_tokens - before.generated_tokens < max_tokens // 4


def test_a_client_leaving_before_its_first_token_is_billed_once(serve_app: ServeApp) -> None:
    """The engine had taken the request (it waits for KV behind a long one) when its client left: the
    ingress stops it on that replica and bills what the engine processed, in exactly one row.

    The KV cache holds 1,024 tokens: the request's 750-token prompt cannot finish its prefill beside the
    filler (which takes it back by preemption each time it runs short), so it stays without a token until
    the filler's 699 decode steps end (ignore_eos: the filler cannot end early)."""
    tenant_id, key = serve_app.new_tenant(f"e2e-leave-{time.monotonic_ns()}", tier="enterprise")
    headers = {"authorization": f"Bearer {key}"}
    # 301 prompt tokens: never the count of a partial prefill of the other (chunks of 127-128 tokens).
    filler = {"model": "tiny-llama", "prompt": [5] * 301, "max_tokens": 699, "temperature": 0, "stream": True,
              "ignore_eos": True}  # fmt: skip
    url = f"{serve_app.url}/v1/completions"
    with httpx.stream("POST", url, json=filler, headers=headers, timeout=60) as held:
        assert held.status_code == 200
        lines = held.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the filler holds most of the KV cache
        waiting_before = engine_stats(serve_app).waiting
        request = {"model": "tiny-llama", "prompt": [6] * 750, "max_tokens": 50, "stream": True}
        body = json.dumps(request).encode()
        host, port = serve_app.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
            deadline = time.monotonic() + 20
            while engine_stats(serve_app).waiting <= waiting_before:  # the engine has it, queued
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.02)
            sock.shutdown(socket.SHUT_RDWR)
    with serve_app.sessions()() as session:
        deadline = time.monotonic() + 30
        while True:
            rows = list(session.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)))
            left = [r for r in rows if r.prompt_tokens != 301]  # not the filler
            if left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
            session.expire_all()
    seen = [(r.status, r.finish_reason, r.prompt_tokens, r.completion_tokens) for r in rows]
    assert len(left) == 1, f"rows (status, finish, prompt, completion): {seen}"
    row = left[0]
    assert row.status == "aborted" and 0 <= row.prompt_tokens <= 750, seen
    # Usually the abort lands while it waits (nothing generated). Beside the other xdist worker's load it
    # has reached the engine only after the filler ended and the request ran (Serve's proxy can notice a
    # client that left only when it writes to it): then it is billed, once, for what the engine generated.
    ran = row.finish_reason == "length" and row.completion_tokens == 50
    assert (row.finish_reason == "abort" and row.completion_tokens < 50) or ran, seen


def test_the_admin_api_is_on_its_own_listener_only(serve_app: ServeApp) -> None:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(f"{serve_app.url}/admin/tenants", headers=headers).status_code == 404
    assert httpx.get(f"{serve_app.admin_url}/admin/tenants", headers=headers).status_code == 200


def replica_processes(serve_app: ServeApp, deployment: str) -> list[psutil.Process]:
    """This app's replica processes of a deployment (a name prefix), by the title Ray gives them."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if not any(f"ServeReplica:loraplex:{deployment}" in part for part in proc.info["cmdline"] or []):
            continue
        try:
            if proc.environ().get("LORAPLEX_DATA_DIR") == str(serve_app.data_dir):
                found.append(proc)
        except psutil.Error:  # another user's, or gone meanwhile: not this app's
            continue
    return found
