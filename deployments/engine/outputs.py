"""What the engine hands back per request and step: text deltas, and usage on the final output."""

import enum
from dataclasses import dataclass, field, replace

from deployments.engine.errors import RequestError


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, the context limit or the request's GPU-time bound (gpu_limited)
    ABORT = "abort"  # the caller aborted (client disconnect)
    ERROR = "error"  # the engine could not serve it (e.g. adapter failed to load)


@dataclass(slots=True)
class RequestUsage:
    """Measured by the engine; the ingress turns it into the OpenAI usage block and the billing event.
    Not frozen, though nothing changes one: every output of every step carries a new one, and a frozen
    dataclass's __init__ (one object.__setattr__ a field) costs ~2.5 us more, ~80 us a step at batch 32."""

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    queue_ms: float  # arrival -> first scheduled
    ttft_ms: float | None  # arrival -> first token (None if none was produced)
    total_ms: float  # arrival -> finish
    gpu_ms: float  # this request's share of each step's device time, at most its max_gpu_ms
    preemptions: int
    replica: str | None = None  # the engine replica that served it


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A token's log-probability under the request's own model (base or adapter): the log-softmax of
    the raw logits, before penalties, biases, grammar masks or temperature; `top` holds the most likely
    tokens at that position, best first (as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one choice of a request. A request with several choices (n, or a list of
    prompts) streams them interleaved: `index` names the choice, `finish_reason` marks a choice's end and
    `finished` the end of the whole request (its last output); `usage` always covers every choice. A
    `whole` request (EngineRequest.whole) gets one output a choice, when that choice ends."""

    request_id: str
    text: str  # new text since the previous output
    token_ids: list[int] = field(default_factory=list)  # new tokens since the previous output
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    usage: RequestUsage | None = None  # so far on every output; final on the finished one
    # Set when finish_reason is ERROR: a named error (an adapter that could not be loaded, RequestFailed),
    # which the ingress maps to its status; details of the cause stay in the engine's log.
    error: RequestError | None = None
    accepted: bool = False  # the announcement that the engine queued it (EngineRequest.announce): no tokens
    index: int = 0  # the choice: prompt number * n + choice number
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when the request asked
    # The prompt's, when asked: once, on the choice's first output; None for the first prompt token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # On a choice's last output: its structured output ran low on max_tokens and the grammar steered it to
    # its shortest completion (GrammarMatcher), so the content is complete but may be cut short.
    closing_forced: bool = False
    # On a choice's last output (finish_reason LENGTH): the request reached its GPU-time bound
    # (EngineRequest.max_gpu_ms), not its max_tokens.
    gpu_limited: bool = False
    # A `whole` output's steps: each one's end in `text` and its token count, for a reader that counts
    # tokens by the text around them (a thinking model's reasoning tokens). None: one step.
    pieces: list[tuple[int, int]] | None = None

    def steps(self) -> list[tuple[int, int]]:
        """(end in `text`, tokens) of each step this output holds."""
        return self.pieces if self.pieces is not None else [(len(self.text), len(self.token_ids))]


def joined(outputs: list[RequestOutput]) -> RequestOutput:
    """Successive outputs of one choice as one, in one pass (a step's join would copy all before it):
    the text, tokens and logprobs of all, the prompt's logprobs from the first that has them, each one's
    steps, the latest usage, and the rest (finish, flags) from the last."""
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    logprobs = None
    if any(o.logprobs is not None for o in outputs):
        logprobs = [lp for o in outputs for lp in o.logprobs or ()]
    pieces: list[tuple[int, int]] = []
    offset = 0
    for o in outputs:
        pieces.extend((offset + end, n) for end, n in o.steps())
        offset += len(o.text)
    return replace(
        last,
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
        logprobs=logprobs,
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
        usage=next((o.usage for o in reversed(outputs) if o.usage is not None), None),
        pieces=pieces,
    )


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A replica's load and residency, for the router, autoscaling and metrics."""

    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks in use
    free_slots: int  # adapter pages free or held by idle adapters (an adapter of rank r takes ceil(r/page))
    device_adapters: list[str]  # refs in device slots
    cpu_adapters: list[str]  # refs in CPU memory
    busy_seconds: float  # sum of step device times
    wall_seconds: float  # since the engine started
    steps: int
    preemptions: int
    prefix_hit_rate: float
    adapter_loads: int  # device slot loads
    adapter_evictions: int
    adapter_requests: int = 0  # requests naming an adapter
    adapter_arrival_hits: int = 0  # ...that found it here already (slot, CPU tier, or loading)
    aborts: int = 0  # requests aborted (the caller left) before they finished
    step_seconds: float = 0.0  # sum of whole steps that ran a forward, plan to outputs (busy_seconds within)
    generated_tokens: int = 0  # output tokens sampled since start
    prefill_tokens: int = 0  # prompt tokens run through the model since start (prefix-cache hits are not)
    adapter_disk_loads: dict[str, int] = field(default_factory=dict)  # ref -> reads from the store
    adapter_read_waits: int = 0  # store reads the admission pass waited for (adapter_read_wait_s)
    # Structured-output requests refused since start, by reason: "schema" (it cannot be enforced),
    # "timeout" (its compile passed the bound, or did so recently) or "busy" (no grammar thread in time).
    grammar_refusals: dict[str, int] = field(default_factory=dict)
    adapter_load_failures: dict[str, int] = field(default_factory=dict)  # ref -> failed loads
    adapter_load_retries: dict[str, int] = field(default_factory=dict)  # ref -> loads tried after a failure
    # Weighted service served per tenant since start (the fair order's counters; "" for no tenant).
    tenant_service: dict[str, float] = field(default_factory=dict)
    # Preemptions since start by reason: "kv" (KV blocks ran out), "adapter_slot" (a slot taken for an
    # adapter past its wait bound), "fair" (a row taken for a tenant past the fair wait bound).
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    # Per tenant with sequences waiting ("" for no tenant): how many, and how long its oldest has waited (s).
    tenant_waiting: dict[str, int] = field(default_factory=dict)
    tenant_oldest_wait_s: dict[str, float] = field(default_factory=dict)
    # ref -> its sequences waiting, for the stats_top_adapters deepest queues only (a bounded label set);
    # adapter_queue_other: the sequences waiting for every other adapter; adapters_queued: adapters waiting.
    adapter_queue: dict[str, int] = field(default_factory=dict)
    adapter_queue_other: int = 0
    adapters_queued: int = 0
    # Adapters waiting for a device slot in the rotation's order, next first (the first stats_top_adapters).
    adapter_rotation: list[str] = field(default_factory=list)
    resident_ranks: dict[str, int] = field(default_factory=dict)  # ref in a device slot -> its LoRA rank
    # Device adapter memory in pages: "total", "in_use" (resident adapters' runs), "page_rank" (rank units).
    adapter_pages: dict[str, int] = field(default_factory=dict)
