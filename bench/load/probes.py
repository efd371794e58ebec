"""Requests outside the load (warm-up, readiness, the probes after recovery), recorded like the load's."""

import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import httpx

from bench.load.options import MODEL
from bench.load.platform import Platform
from bench.load.tenants import TenantSetup

if TYPE_CHECKING:
    from bench.locustfile import Result


def one_request(
    url: str, tenant: TenantSetup, model: str, *, stream: bool, phase: str, timeout: float = 120
) -> "Result":
    """A request outside the load (warm-up, probe), recorded the same way so its usage row is expected."""
    from bench.locustfile import Result

    body: dict[str, Any] = {"model": model, "prompt": f"{phase} probe", "max_tokens": 3}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    headers = {"authorization": f"Bearer {tenant.key}"}
    result = Result(tenant.name, "completion", stream, model, 0, "transport", time.time(), 0.0)
    try:
        with (
            httpx.Client(base_url=url, timeout=timeout) as client,
            client.stream("POST", "/v1/completions", json=body, headers=headers) as response,
        ):
            result.status = response.status_code
            text = response.read().decode()
        if result.status == 200 and stream:
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            error = next((e for e in events if "error" in e), None)
            result.request_id = events[0].get("id") if events else None
            usage = next((e["usage"] for e in events if e.get("usage")), None)
            result.usage = None if usage is None else (usage["prompt_tokens"], usage["completion_tokens"])
            ended = "data: [DONE]" in text
            result.outcome = "stream_error" if error else "ok" if ended else "truncated"
        elif result.status == 200:
            data = json.loads(text)
            result.request_id = data["id"]
            result.usage = (data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"])
            result.outcome = "ok"
        else:
            result.outcome = "unavailable" if result.status == 503 else "other"
            result.detail = text[:300]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        result.detail = f"{type(error).__name__}: {error}"[:300]
    result.ended = time.time()
    return result


def wait_ready(platform: Platform, tenants: list[TenantSetup], extra: list["Result"], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if platform.serve is not None and platform.serve.poll() is not None:
            raise RuntimeError(
                f"serve run exited ({platform.serve.returncode}); see {platform.workdir}/serve.log"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{platform.url}/healthz", timeout=5).status_code == 200:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the platform did not answer /healthz; see {platform.workdir}/serve.log")
        time.sleep(2)
    left = max(30.0, deadline - time.monotonic())
    state = platform.ray_ops(
        "--expect", platform.expected(), "--timeout", str(left), "healthy", timeout=left + 60
    )
    if not state.get("ok"):
        raise TimeoutError(f"deployments not healthy: {state}")
    ent = tenants[0]
    for model in (MODEL, "public/demo-sql"):  # warm: both engines' first batches, an adapter load
        while (warm := one_request(platform.url, ent, model, stream=False, phase="warmup")).outcome != "ok":
            extra.append(warm)
            if time.monotonic() > deadline:
                raise TimeoutError(f"warm-up request failed: {warm.status} {warm.detail}")
            time.sleep(2)
        extra.append(warm)


def probes(platform: Platform, tenants: list[TenantSetup], timeout: float) -> tuple[bool, list["Result"]]:
    """After the faults, with nothing restarted by hand: the enterprise tenant is served again, base model
    and adapter, streamed and not (a 503 is retried: recovery may still be under way)."""
    done: list[Result] = []
    ent = tenants[0]
    deadline = time.monotonic() + timeout
    for model, stream in ((MODEL, False), ("public/demo-poet", True), ("public/demo-sql", False)):
        while True:
            result = one_request(platform.url, ent, model, stream=stream, phase="probe")
            done.append(result)
            if result.outcome == "ok":
                break
            if time.monotonic() > deadline:
                return False, done
            time.sleep(2)
    return True, done
