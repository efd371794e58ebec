"""The real Serve app for the end-to-end benches: a local Ray cluster of this process's own (loopback, a
free HTTP port, a random GCS port, never 6379), the app graph of `serve run serve_config.yaml`
(deployments.builder:build_app: ingress with auth, rate limiter and metering, engine deployments and the
router), a fresh SQLite database and adapter store; plus the admin calls and the streamed client the benches
share. Used by bench.routing, bench.http_load and bench.prefix_reuse; not a bench itself.
"""

import contextlib
import json
import math
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import ray
import torch
from ray import serve

from bench.admin_upload import post_adapter
from bench.routing_counters import Snapshot
from billing.migrate import upgrade
from deployments.builder import build_app

APP = "loraplex"
# bench.routing's engine: small KV blocks and batches, so a few short requests exercise the slots.
ROUTING_ENGINE: dict[str, Any] = {
    "num_kv_blocks": 256,
    "block_size": 4,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 128,
    "max_loras": 4,
    "max_cpu_loras": 64,
}


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    key: str


class Platform:
    """A running app on this process's Ray cluster, reached over HTTP like any client."""

    def __init__(self, url: str, admin_key: str, model_dir: Path, model: str = "tiny-llama") -> None:
        self.url, self.admin_key, self.model_dir, self.model = url, admin_key, model_dir, model
        self.seen: set[str] = set()  # replicas of earlier deployments: never counted again

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {self.admin_key}"}, timeout=60
        )

    def deploy(
        self,
        router: str,
        replicas: int,
        spill_factor: float = 1.5,
        engine: dict[str, Any] | None = None,
    ) -> set[str]:
        """One model, `replicas` fresh engine replicas behind `router` (bench.routing's engine by default)."""
        model = self.model_spec(self.model, router, replicas, spill_factor, engine or ROUTING_ENGINE)
        return self.deploy_models([model])[self.model]

    def model_spec(
        self, name: str, router: str, replicas: int, spill_factor: float, engine: dict[str, Any]
    ) -> dict[str, Any]:
        """One entry of `models` in serve_config.yaml's args, over this platform's model directory."""
        return {"name": name, "engine": {"model": str(self.model_dir), **engine}, "num_replicas": replicas,
                "router": router, "spill_factor": spill_factor, "report_interval_s": 0.5}  # fmt: skip

    def deploy_models(self, models: list[dict[str, Any]], **app_args: Any) -> dict[str, set[str]]:
        """Fresh replicas of every model: the old app goes first, so nothing survives from a previous run.
        Returns model name -> its live replicas once all report (GET /admin/routing)."""
        if APP in serve.status().applications:
            serve.delete(APP)
        serve.run(build_app({"models": models, **app_args}), name=APP, route_prefix="/", blocking=False)
        want = {m["name"]: int(m.get("num_replicas", 1)) for m in models}
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = serve.status().applications.get(APP)
            live = {name: {r["replica"] for r in self.routing(1.5, name)} - self.seen for name in want}
            if (
                status is not None
                and status.status == "RUNNING"
                and all(len(live[n]) == k for n, k in want.items())
            ):
                for replicas in live.values():
                    self.seen |= replicas
                return live
            time.sleep(0.5)
        raise TimeoutError(f"fresh replicas not reporting: {serve.status()}")

    def routing(self, within_s: float, model: str | None = None) -> list[dict[str, Any]]:
        try:
            with self.admin() as admin:
                params: dict[str, str | float] = {"model": model or self.model, "within_s": within_s}
                reply = admin.get("/admin/routing", params=params)
        except httpx.HTTPError:  # between apps, or the ingress still starting
            return []
        if reply.status_code != 200:
            return []
        data: list[dict[str, Any]] = reply.json()["data"]
        return data[0]["replicas"] if data else []

    def snapshot(self, replicas: set[str]) -> Snapshot:
        """Counters of `replicas`, each from a report written after this call (so everything sent is in)."""
        since = datetime.now(UTC)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.5)
            rows = {r["replica"]: r for r in self.routing(within_s=5) if r["replica"] in replicas}
            if len(rows) == len(replicas) and all(_at(r["reported_at"]) > since for r in rows.values()):
                return rows
        raise TimeoutError(f"replicas {sorted(replicas)} stopped reporting")

    # -- admin ------------------------------------------------------------------------------------------

    def tenant(self, name: str, tier: str = "enterprise", **overrides: int) -> Tenant:
        """A tenant on `tier` (limit overrides: rpm, tpm, max_concurrent, max_tokens_cap) and one API key."""
        with self.admin() as admin:
            made = admin.post("/admin/tenants", json={"name": name, "tier": tier})
            made.raise_for_status()
            tenant_id = made.json()["id"]
            if overrides:
                admin.patch(f"/admin/tenants/{tenant_id}", json=overrides).raise_for_status()
            key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={})
            key.raise_for_status()
        return Tenant(tenant_id, name, key.json()["key"])

    def upload(self, name: str, owner: str, adapter_dir: Path, base_model: str | None = None) -> None:
        """POST /admin/adapters: `owner` is a tenant id or "public"."""
        with self.admin() as admin:
            post_adapter(admin, name, owner, adapter_dir, base_model or self.model).raise_for_status()

    def usage(
        self, start: datetime, end: datetime, tenant_id: str, group_by: str = "model"
    ) -> list[dict[str, Any]]:
        """GET /admin/usage rows of one tenant (live: the metering rows recorded so far)."""
        params = {"start": start.isoformat(), "end": end.isoformat(), "tenant_id": tenant_id,
                  "group_by": group_by}  # fmt: skip
        with self.admin() as admin:
            reply = admin.get("/admin/usage", params=params)
        reply.raise_for_status()
        rows: list[dict[str, Any]] = reply.json()["data"]
        return rows


def _at(stamp: str) -> datetime:
    parsed = datetime.fromisoformat(stamp)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@contextlib.contextmanager
def local_platform(
    model_dir: Path, model: str = "tiny-llama", *, auth_cache_ttl_s: float = 0.2, num_cpus: int = 2
) -> Iterator[Platform]:
    """A Ray cluster of this process's own with Serve on a free loopback port, a fresh database and store;
    everything is stopped and deleted on exit (only what this call started)."""
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"loraplex-bench-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    database_url = f"sqlite:///{work / 'loraplex.db'}"
    upgrade(database_url)
    env = {
        "RAY_AUTH_MODE": "disabled",  # Ray 2.60 turns token auth on for new local clusters
        "LORAPLEX_DATA_DIR": str(work),
        "LORAPLEX_DATABASE_URL": database_url,
        "LORAPLEX_ADMIN_KEY": secrets.token_urlsafe(32),
        "LORAPLEX_AUTH_CACHE_TTL_S": str(auth_cache_ttl_s),
        "LORAPLEX_ADAPTER_STORE": str(work / "adapters"),
    }
    os.environ.update(env)  # build_app reads Settings here; workers get the same through runtime_env
    os.environ.pop("RAY_GCS_SERVER_PORT", None)  # unset: a local cluster takes a random GCS port, not 6379
    ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, log_to_driver=False,
             runtime_env={"env_vars": env})  # fmt: skip
    try:
        port = _start_serve()
        yield Platform(f"http://127.0.0.1:{port}", env["LORAPLEX_ADMIN_KEY"], model_dir, model)
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)  # the database, store and adapters: this run's only


def _start_serve(attempts: int = 3) -> int:
    """Serve's HTTP proxy on a free loopback port; another process may take the port between our probe
    and the proxy's bind (the suite runs clusters side by side), so a lost race picks another."""
    for attempt in range(1, attempts + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except ray.exceptions.RayTaskError as error:
            if "Failed to bind" not in str(error) or attempt == attempts:
                raise
            serve.shutdown()  # type: ignore[no-untyped-call]
    raise AssertionError("unreachable")


# -- adapters -----------------------------------------------------------------------------------------------


def build_adapters(model_dir: Path, ranks: list[int], out_root: Path, seed: int = 0) -> list[Path]:
    """One real PEFT adapter per rank in `ranks` (all linears of the model, random non-zero B), as
    directories under out_root: one wrapped model per distinct rank, re-randomised per adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bench.assets import lora_targets

    out: list[Path] = [out_root / f"a{i:03d}-r{r}" for i, r in enumerate(ranks)]
    for rank in sorted(set(ranks)):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=lora_targets(base))
        model = get_peft_model(base, config)
        for i, r in enumerate(ranks):
            if r != rank:
                continue
            generator = torch.Generator().manual_seed(seed * 7919 + i)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_A" in name or "lora_B" in name:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            model.save_pretrained(str(out[i]))
    return out


# -- the streamed client ----------------------------------------------------------------------------------


@dataclass
class Streamed:
    """One streamed request as the client saw it."""

    status: int
    # The first chunk carrying a token: text, or the choice's end (a token without text); never the chat
    # stream's opening role chunk.
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)  # gaps between chunks with text
    total_ms: float = 0.0
    usage: dict[str, Any] | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return int(cached) if cached is not None else None


def _content(event: dict[str, Any]) -> str:
    text = ""
    for choice in event.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], key: str) -> Streamed:
    """POST `body` (stream on, usage asked) to `path` with the API key; TTFT and ITL by token chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    out = Streamed(status=0)
    try:
        async with client.stream(
            "POST", path, json=body, headers={"authorization": f"Bearer {key}"}
        ) as reply:
            out.status = reply.status_code
            if reply.status_code != 200:
                out.error = (await reply.aread()).decode(errors="replace")[:300]
                return out
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"])[:300]
                    continue
                if event.get("usage"):
                    out.usage = event["usage"]
                piece = _content(event)
                # A token that decodes to no text (EOS, half a character) shows only as its choice's end.
                ended = any(c.get("finish_reason") for c in event.get("choices") or [])
                if piece or (ended and out.ttft_ms is None):
                    now = time.perf_counter()
                    if out.ttft_ms is None:
                        out.ttft_ms = (now - start) * 1e3
                    else:
                        out.itl_ms.append((now - last) * 1e3)
                    last = now
                    out.text += piece
    except httpx.HTTPError as error:
        out.error = f"{type(error).__name__}: {error}"
    out.total_ms = (time.perf_counter() - start) * 1e3
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
