"""Prefix reuse across turns, end to end: follow-up-turn TTFT when the router sends a turn to the replica
holding its conversation's KV (ours: adapter-aware, prefix affinity), against Serve's default router and
against a cold cache, in one run, through the real Serve app (HTTP proxy, ingress with auth, rate limiter
and metering, engine deployments): the graph `serve run serve_config.yaml` builds.

One app serves three copies of the same base model (same weights, same engine config):
  <m>-ours     `--replicas` engine replicas, router adapter_aware (the shipped default)
  <m>-default  `--replicas` engine replicas, router default (Ray Serve's power-of-two-choices)
  <m>-cold     one replica with the prefix cache off: every prompt is prefilled in full
Tenants each have a long system prompt; each (tenant, adapter) pair holds several conversations of several
turns (a new user message plus a canned assistant reply per turn, so the history grows). Every turn is
sent to ours and default; every follow-up turn (2..N) also to cold, in one round per turn with the order
of the three rotated, so neighbours hit all three alike. Requests are sequential, streamed chat
completions, greedy, max_tokens 1 (TTFT is the measure; with one token the KV a request leaves behind is
exactly its prompt's full blocks, so the reuse the next turn should see is known in advance).

cached_tokens: `usage.prompt_tokens_details.cached_tokens` of each follow-up, against the exact expectation
computed here with the app's own PromptBuilder (the model's tokenizer and chat template): the longest
prefix, in whole KV blocks (block_size), shared with a prompt this (tenant, adapter) sent before, capped so
one prompt token is left to compute. `cached_tokens_exact` is true when every follow-up on ours reported
exactly that and every cold request 0. Ratios are per round (ours / cold, default / cold), medians with
spread (bench.measure).
The model is the ~150M bench preset by default: on a 2-core CPU its prefill of a ~1.5k-token prompt takes
~1.4 s, so TTFT is mostly prefill and the ratio means something (the smaller demo preset prefills it in
~0.2 s, close to the fixed cost any request pays through the platform; `short_prompt_ttft_ms` reports it).
Run: python -m bench.prefix_reuse [--tiny] [--preset bench-150m] [--replicas 2] [--turns 4]
     [--system-tokens 1024]; the last line is one JSON object.
"""

import argparse
import asyncio
import json
import logging
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.modelprep.demo_model import ensure_model
from app.schemas.openai import ChatMessage
from app.served_models.prompts import PromptBuilder
from bench.measure import machine, spread
from bench.serve_platform import Platform, Tenant, build_adapters, local_platform, stream
from deployments.engine.config import EngineConfig

ROUTERS = ("ours", "default")
PEERS = ("ours", "default", "cold")
VOCABULARY = (
    "table query index join schema column order account invoice customer region report metric latency "
    "batch window filter group count average revenue product shipment warehouse forecast policy ticket "
    "status priority owner review release deploy rollback cluster replica adapter tenant budget quota"
)
WORDS = VOCABULARY.split()


@dataclass
class Conversation:
    tenant: Tenant
    adapter: str  # the adapter's name, without the deployment suffix
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Sent:
    """What one follow-up turn gave on one peer."""

    ttft_ms: float
    cached: int | None
    expected: int
    prompt_tokens: int | None
    length: int  # the prompt's tokens, as tokenised here


def text_of(rnd: random.Random, tokens: int, builder: PromptBuilder) -> str:
    """Sentences of WORDS until the tokenizer gives at least `tokens` tokens."""
    sentences: list[str] = []
    while len(builder.tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < tokens:
        sentences.append(" ".join(rnd.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return " ".join(sentences)


def expected_cached(prompt: list[int], earlier: list[list[int]], block_size: int) -> int:
    """Tokens the engine's prefix cache should serve: whole blocks of the longest prefix shared with a
    prompt computed before (its full blocks only), leaving at least one prompt token to compute."""
    best = 0
    for other in earlier:
        common = 0
        for a, b in zip(prompt, other, strict=False):
            if a != b:
                break
            common += 1
        best = max(best, min(common // block_size, len(other) // block_size))
    return min(best, (len(prompt) - 1) // block_size) * block_size


class Bench:
    def __init__(self, platform: Platform, builder: PromptBuilder, args: argparse.Namespace) -> None:
        self.platform, self.builder, self.args = platform, builder, args
        self.sent: dict[tuple[str, str, str], list[list[int]]] = {}  # (peer, tenant, adapter) -> prompts
        self.results: dict[str, list[Sent]] = {peer: [] for peer in PEERS}
        self.first_turn: dict[str, list[float]] = {r: [] for r in ROUTERS}
        self.floor: list[float] = []  # short, unrelated prompts on ours: what any request pays
        self.errors = 0

    def model(self, peer: str) -> str:
        return f"{self.platform.model}-{peer}"

    async def send(
        self, client: httpx.AsyncClient, peer: str, conv: Conversation, ids: list[int]
    ) -> Sent | None:
        body = {
            "model": f"{conv.adapter}-{peer}",
            "messages": [{"role": "system", "content": conv.system}, *conv.messages],
            "max_tokens": 1,
            "temperature": 0,
        }
        got = await stream(client, "/v1/chat/completions", body, conv.tenant.key)
        group = (peer, conv.tenant.id, conv.adapter)
        earlier = self.sent.setdefault(group, [])
        expected = 0 if peer == "cold" else expected_cached(ids, earlier, self.args.block_size)
        earlier.append(ids)
        if not got.ok or got.ttft_ms is None:
            self.errors += 1
            logging.warning("%s failed: %s %s", peer, got.status, got.error)
            return None
        prompt_tokens = (got.usage or {}).get("prompt_tokens")
        return Sent(got.ttft_ms, got.cached_tokens, expected, prompt_tokens, len(ids))

    def prompt_ids(self, conv: Conversation) -> list[int]:
        messages = [ChatMessage.model_validate(m) for m in [{"role": "system", "content": conv.system},
                                                            *conv.messages]]  # fmt: skip
        return self.builder.chat(messages)

    async def warm_up(self, client: httpx.AsyncClient, tenants: list[Tenant], adapters: list[str]) -> None:
        """Every adapter into every replica's slots (short, unrelated prompts: no prefix to share), so no
        measured turn pays an adapter load: 4 requests per replica and adapter on each deployment."""
        rnd = random.Random(99)
        calls = []
        for peer in PEERS:
            replicas = 1 if peer == "cold" else self.args.replicas
            for tenant in tenants:
                for adapter in adapters:
                    for _ in range(4 * replicas):
                        content = text_of(rnd, 8, self.builder) + f" {rnd.random()}"
                        body = {"model": f"{adapter}-{peer}", "max_tokens": 1,
                                "messages": [{"role": "user", "content": content}]}  # fmt: skip
                        calls.append(stream(client, "/v1/chat/completions", body, tenant.key))
        for got in await asyncio.gather(*calls):
            if not got.ok:
                raise RuntimeError(f"warm-up failed: {got.status} {got.error}")
        for i in range(6):  # one at a time, as the turns are sent
            content = text_of(rnd, 8, self.builder) + f" {rnd.random()}"
            body = {"model": f"{adapters[i % len(adapters)]}-ours", "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": content}]}  # fmt: skip
            got = await stream(client, "/v1/chat/completions", body, tenants[0].key)
            if got.ok and got.ttft_ms is not None:
                self.floor.append(got.ttft_ms)

    async def run(self, tenants: list[Tenant], adapters: list[str]) -> None:
        rnd = random.Random(0)
        conversations: list[Conversation] = []
        for tenant in tenants:
            system = text_of(rnd, self.args.system_tokens, self.builder)
            for adapter in adapters:
                for _ in range(self.args.conversations):
                    conversations.append(Conversation(tenant, adapter, system))
        async with httpx.AsyncClient(base_url=self.platform.url, timeout=600) as client:
            await self.warm_up(client, tenants, adapters)
            rounds = 0
            for turn in range(self.args.turns):
                for conv in conversations:
                    if turn:  # the previous turn's reply, as the client would send it back
                        reply = text_of(rnd, self.args.reply_tokens, self.builder)
                        conv.messages.append({"role": "assistant", "content": reply})
                    user = text_of(rnd, self.args.user_tokens, self.builder)
                    conv.messages.append({"role": "user", "content": user})
                    ids = self.prompt_ids(conv)
                    peers = list(PEERS) if turn else list(ROUTERS)
                    k = rounds % len(peers)
                    rounds += 1
                    got: dict[str, Sent | None] = {}
                    for peer in peers[k:] + peers[:k]:
                        got[peer] = await self.send(client, peer, conv, ids)
                    for peer, sent in got.items():
                        if sent is None:
                            continue
                        if turn:
                            self.results[peer].append(sent)
                        else:
                            self.first_turn[peer].append(sent.ttft_ms)

    def summary(self) -> dict[str, Any]:
        res = self.results
        n = min(len(res[p]) for p in PEERS)

        def ratio(peer: str) -> dict[str, float] | None:
            pairs = [a.ttft_ms / b.ttft_ms for a, b in zip(res[peer][:n], res["cold"][:n], strict=True)]
            return spread(pairs) if pairs else None

        def cached(peer: str) -> dict[str, Any]:
            rows = res[peer]
            return {
                "reported": sum(s.cached or 0 for s in rows),
                "expected": sum(s.expected for s in rows),
                "exact_turns": sum(s.cached == s.expected for s in rows),
                "turns": len(rows),
                "mean_prompt_tokens": round(statistics.mean(s.length for s in rows), 1) if rows else None,
            }

        exact = bool(res["ours"]) and all(s.cached == s.expected for s in res["ours"] + res["cold"])
        tokenised_alike = all(s.prompt_tokens == s.length for p in PEERS for s in res[p])
        ours_ratio, default_ratio = ratio("ours"), ratio("default")
        return {
            "followup_ttft_ms": {r: spread([s.ttft_ms for s in res[r]]) for r in ROUTERS if res[r]},
            "cold_ttft_ms": spread([s.ttft_ms for s in res["cold"]]) if res["cold"] else None,
            "first_turn_ttft_ms": {r: spread(v) for r, v in self.first_turn.items() if v},
            "short_prompt_ttft_ms": spread(self.floor) if self.floor else None,
            "ratio_followup_vs_cold": ours_ratio,
            "ratio_default_vs_cold": default_ratio,
            "goal_followup_le_0_2_cold": ours_ratio is not None and ours_ratio["median"] <= 0.2,
            "cached_tokens_exact": exact,
            "cached_tokens": {p: cached(p) for p in PEERS},
            "prompt_tokens_match_tokenizer": tokenised_alike,
            "errors": self.errors,
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset",
        default="bench-150m",
        help="model preset (app.modelprep.demo_model): prefill must dominate",
    )
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas of ours and of default")
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=2, help="adapters per tenant")
    parser.add_argument("--conversations", type=int, default=2, help="per (tenant, adapter)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="per replica: no eviction in a run")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model, 1 replica each, 1 tenant x 2 adapters, 3 turns"
    )
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.tenants, args.adapters, args.conversations, args.turns = "tiny", 1, 2, 1, 3
        args.replicas = 1  # three engine replicas in all: starting them is most of the time
        args.system_tokens, args.user_tokens, args.reply_tokens = 256, 24, 16
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = ensure_model(Path(f"var/bench/{args.preset}"), arch="llama", preset=args.preset).resolve()
    builder = PromptBuilder(model_dir)
    engine = {"block_size": args.block_size, "num_kv_blocks": args.num_kv_blocks, "max_num_seqs": 8,
              "max_num_batched_tokens": 512, "max_loras": 4, "max_cpu_loras": 16,
              "max_lora_rank": 16}  # fmt: skip
    dtype = str(EngineConfig(model=model_dir, adapter_store="unused").torch_dtype()).removeprefix("torch.")
    start = time.perf_counter()
    with local_platform(model_dir, "m") as platform:
        models = [
            platform.model_spec("m-ours", "adapter_aware", args.replicas, 1.5, engine),
            platform.model_spec("m-default", "default", args.replicas, 1.5, engine),
            platform.model_spec(
                "m-cold", "adapter_aware", 1, 1.5, {**engine, "enable_prefix_caching": False}
            ),
        ]
        platform.deploy_models(models)
        tenants = [platform.tenant(f"prefix-{t}", "enterprise") for t in range(args.tenants)]
        with tempfile.TemporaryDirectory(prefix="prefix-reuse-") as work:
            ranks = [(4, 8, 16)[i % 3] for i in range(args.adapters)]  # mixed ranks
            dirs = build_adapters(model_dir, ranks, Path(work))
            adapters = [f"a{i}" for i in range(args.adapters)]
            for tenant in tenants:
                for name, path in zip(adapters, dirs, strict=True):
                    for peer in PEERS:
                        platform.upload(f"{name}-{peer}", tenant.id, path, base_model=f"m-{peer}")
        bench = Bench(platform, builder, args)
        asyncio.run(bench.run(tenants, adapters))
    summary = bench.summary()
    print(f"{'':12}{'median ms':>12}{'min':>10}{'max':>10}")
    for name, row in [*summary["followup_ttft_ms"].items(), ("cold", summary["cold_ttft_ms"])]:
        if row:
            print(f"{name:12}{row['median']:>12.1f}{row['min']:>10.1f}{row['max']:>10.1f}")
    result = {
        "bench": "prefix_reuse",
        "preset": args.preset,
        "replicas": args.replicas,
        "tenants": args.tenants,
        "adapters_per_tenant": args.adapters,
        "conversations": args.conversations,
        "turns": args.turns,
        "system_tokens": args.system_tokens,
        "block_size": args.block_size,
        **summary,
        "wall_s": round(time.perf_counter() - start, 1),
        "machine": machine(dtype),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
