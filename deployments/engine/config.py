"""EngineConfig: everything one engine replica needs to know, validated up front."""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from adapters.store import store_location
from deployments.engine.cpu_features import cpu_features

# torch is imported where a device or dtype is resolved: importing the config (the ingress does, through
# the interface) must not import torch.
if TYPE_CHECKING:
    import torch

Quantization = Literal["none", "nf4", "int8", "awq"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
AwqKernel = Literal["auto", "ours", "gptqmodel"]

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",  # Phi-3/Phi-4's fused q/k/v and gate/up linears: adapters on them are served as PEFT's
    "gate_up_proj",
)


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path = Field(
        description="Local HuggingFace model directory (config.json, safetensors, tokenizer)."
    )
    served_model_name: str | None = Field(
        default=None, description="Name clients use for the base model; defaults to the directory name."
    )
    quantization: Quantization = Field(
        default="none",
        description="Base weights: none (dtype below), bitsandbytes nf4 or int8, or an AWQ checkpoint.",
    )
    awq_kernel: AwqKernel = Field(
        default="auto",
        description=(
            "Which code runs an AWQ base's int4 linears. ours: our AwqLinear on the checkpoint's packed "
            "tensors (Triton kernels on CUDA, inside the decode graphs; a torch dequantize on a CPU without "
            "Triton). gptqmodel: transformers' AWQ loading through gptqmodel (CPU int4 kernel). auto: ours "
            "on CUDA or where gptqmodel is not installed, gptqmodel otherwise."
        ),
    )
    awq_fused_max_rows: int = Field(
        default=0,
        ge=0,
        description=(
            "Our AWQ linear runs its fused int4 GEMM for calls of at most this many token rows (decode "
            "buckets) and dequantize-once + one dense matmul above it. 0 (default): always the latter, which "
            "an H200 ran 2.3x faster than our untuned fused GEMM at 1 row; bench.gpu_check's awq step "
            "measures both sides."
        ),
    )
    dtype: DTypeName = Field(
        default="auto",
        description=(
            "Compute dtype. auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX), "
            "float32 on other CPUs, where bf16 is emulated and slower than fp32. Set float32 for exact "
            "reference matching."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto picks CUDA if present.")
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description=(
            "torch's intra-op threads in a served engine's process (the forward on a CPU, host work on a "
            "GPU). Unset: the cores this process may run on less one, at least one. The core left runs "
            "the replica's event loop, the app and the batch runner; a forward whose parallel regions span "
            "every core waits at each region for a worker that such work preempted, which made a 2-core "
            "decode step 2.5x slower beside one busy process (bench/cpu_threads.py)."
        ),
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description=(
            "Device adapter memory as a count of max_lora_rank adapters (1 to 256); unset: as much as "
            "lora_memory_mb holds. Adapters of lower rank take less of it (lora_page_rank), so more fit."
        ),
    )
    lora_memory_mb: int = Field(
        default=512,
        ge=1,
        description=(
            "Device memory for adapters when max_loras is unset, in pages of lora_page_rank rank units on "
            "every target module (compute dtype): it holds the sum of the resident adapters' ranks."
        ),
    )
    lora_page_rank: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description=(
            "Rank units in one page of adapter memory: an adapter of rank r takes ceil(r / page) pages (the "
            "last padded with zeros), so narrower pages waste less memory. Unset: 16 (or max_lora_rank if "
            "smaller) on CPU; max_lora_rank on CUDA until a GPU run measures the Triton LoRA kernel on runs "
            "of pages (it reads them, graphs included; set it to use them there)."
        ),
    )
    max_cpu_loras: int = Field(default=32, ge=1, description="Adapters kept in CPU memory (LRU).")
    max_lora_rank: int = Field(default=16, ge=1, le=256, description="Largest servable rank.")
    lora_target_modules: tuple[str, ...] = Field(
        default=DEFAULT_LORA_TARGETS, description="Linear module names that accept LoRA deltas."
    )
    adapter_store: Annotated[str | Path, AfterValidator(store_location)] = Field(
        description="Versioned adapter store: a directory, file:///dir, s3://bucket/prefix, an fsspec URL."
    )
    adapter_cache_dir: Path | None = Field(
        default=None,
        description=(
            "Node-local cache of versions read from an object store, shared by the node's replicas; unset: "
            "a per-user directory under the system temp dir. A local store is read in place, uncached."
        ),
    )
    adapter_cache_mb: int = Field(
        default=10240,
        ge=1,
        description="Size bound of adapter_cache_dir; least recently used versions go first.",
    )
    block_size: int = Field(default=16, ge=1, le=256, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(
        default=None, ge=2, description="KV-cache blocks; when unset, sized from kv_cache_memory_mb."
    )
    kv_cache_memory_mb: int = Field(
        default=256, ge=1, description="KV-cache budget when num_kv_blocks unset."
    )
    max_num_seqs: int = Field(
        default=DEFAULT_MAX_NUM_SEQS,
        ge=1,
        description="Sequences decoded together in one step; also the most one request runs (n x prompts).",
    )
    max_num_batched_tokens: int = Field(
        default=512, ge=16, description="Per-step token budget; long prompts are prefilled in chunks of it."
    )
    max_prompt_logprob_rows: int | None = Field(
        default=None,
        ge=1,
        description="Prompt positions whose logprobs one step computes; when unset, sized from "
        "prompt_logprobs_memory_mb.",
    )
    prompt_logprobs_memory_mb: int = Field(
        default=256,
        ge=1,
        description=(
            "Device memory for one step's prompt logprobs (echo with logprobs): each position needs the "
            "vocabulary's logits and their log-softmax in float32. A prompt asking for them is prefilled in "
            "chunks of as many positions as fit (at least one), so a step never holds more."
        ),
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="Context limit (prompt + output); defaults to the model's."
    )
    max_waiting: int = Field(
        default=4096,
        ge=1,
        description=(
            "Waiting sequences (each choice of each prompt counts) beyond which a request is refused; while "
            "other tenants wait, one tenant's take at most half of them."
        ),
    )
    scheduling: Literal["fair", "fifo"] = Field(
        default="fair",
        description=(
            "Order of admission from the waiting queue. fair: the next request of the waiting tenant served "
            "least so far (prompt tokens, cached prompt tokens at a quarter, output tokens at twice, divided "
            "by the request's tenant_weight; a tenant arriving is lifted to the least counter of the active "
            "ones, so idle time banks no credit), first in first out within a tenant. fifo: arrival order "
            "across tenants."
        ),
    )
    fair_wait_bound_s: float = Field(
        default=0.1,
        ge=0,
        description=(
            "With scheduling fair, when every row is taken and the next tenant in the fair order has waited "
            "this long, the newest running sequence of the most served other tenant is preempted for it (at "
            "most one a step; it resumes from the prefix cache at the head of its tenant's queue), so long "
            "outputs cannot hold a replica. 0 turns it off (waiters take rows as they free)."
        ),
    )
    batch_step_tokens: int = Field(
        default=32,
        ge=1,
        description=(
            "Tokens of the batch class (Batch API lines) one step may compute while interactive sequences "
            "run or wait (or did within batch_interactive_window_s): decode rows and prefill chunks alike, "
            "so a batch beside live traffic adds a bounded amount to each step (interactive latency) and "
            "still progresses. Without interactive work the batch class gets the whole step "
            "(max_num_batched_tokens)."
        ),
    )
    batch_step_slack: float | None = Field(
        default=0.1,
        ge=0,
        description=(
            "Beside interactive work, the batch class's tokens in a step are also bounded by time: at most "
            "what keeps the step within 1 + this of the time of its interactive work alone, by the "
            "replica's own fit of its step time against tokens and sampled rows (a CPU, where a decode row "
            "costs a large part of a step, gives a row every few steps; a GPU's memory-bound decode gives up "
            "to batch_step_tokens). The bound holds on average: a token that costs more than a step's share "
            "goes when the share is not overdrawn and is repaid by the next steps; at least one goes every "
            "16 steps, so a batch always progresses. null: batch_step_tokens alone."
        ),
    )
    batch_interactive_window_s: float = Field(
        default=2.0,
        ge=0,
        description=(
            "For this long after an interactive sequence last ran or waited, steps with only batch-class "
            "work are bounded as beside interactive work (batch_step_tokens, batch_step_slack), so an "
            "interactive request arriving between others waits for a short step, not a whole step of batch "
            "prefill. An idle replica's batch takes whole steps (max_num_batched_tokens). 0: whole steps "
            "whenever no interactive sequence runs or waits."
        ),
    )
    adapter_wait_bound_s: float = Field(
        default=1.0,
        ge=0,
        description=(
            "A request that has waited this long for a device slot takes one: the running users of the least "
            "wanted slot are preempted (their KV stays in the prefix cache), so no adapter waits unboundedly "
            "for busy slots to drain. 0 turns it off (slots only drain)."
        ),
    )
    adapter_min_residency_s: float = Field(
        default=1.0,
        ge=0,
        description=(
            "An adapter loaded into a slot keeps it this long while it has requests queued (the slot is "
            "neither evicted nor drained for another adapter waiting in the rotation), and no slot is taken "
            "by force (its running users preempted) sooner. Bounds how fast many waiting adapters can trade "
            "slots (churn); 0: slots trade as soon as another adapter waits."
        ),
    )
    adapter_read_wait_s: float = Field(
        default=0.02,
        ge=0,
        description=(
            "When the store's recent reads took at most this long (a local disk), a read started for an "
            "adapter about to take a slot for interactive work is waited for, at most this long a step: its "
            "request then starts in this step instead of the next, at the price of this step's delay for the "
            "requests already running. A slower store (an object store) is never waited for. 0: never wait."
        ),
    )
    stats_top_adapters: int = Field(
        default=16,
        ge=1,
        description=(
            "How many adapters stats name in their per-adapter queue figures (the deepest queues, and the "
            "first of the slot rotation); the rest are summed into one figure, so the metrics' adapter label "
            "stays bounded however many adapters queue."
        ),
    )
    adapter_retry_s: float = Field(
        default=1.0,
        gt=0,
        description=(
            "After an adapter version fails to load (store down, files missing or corrupt), requests for it "
            "fail at once for this long; then the next one loads it again. Doubles with each further "
            "failure, up to adapter_retry_max_s."
        ),
    )
    adapter_retry_max_s: float = Field(
        default=30.0, gt=0, description="The longest backoff between loads of a version that keeps failing."
    )
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV blocks of identical prefixes.")
    cuda_graphs: bool = Field(
        default=True,
        description=(
            "On CUDA, capture each decode batch bucket's forward in a CUDA graph at start and replay it each "
            "decode step (the step's host cost drops to one launch). Off: every step runs eagerly."
        ),
    )
    seed: int = Field(default=0, description="Seed of the generator used by requests without their own.")
    grammar_compile_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description=(
            "A structured-output request whose grammar is not compiled within this long, time waiting for a "
            "grammar thread included, is refused: 400 (and its schema refused for grammar_refusal_ttl_s) if "
            "its compile had started, 503 if no thread took it."
        ),
    )
    grammar_refusal_ttl_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description=(
            "How long a schema whose compile passed grammar_compile_timeout_s stays refused for its tenant "
            "(at once, without compiling): long enough that resending it cannot keep the grammar threads "
            "busy, short enough that a valid schema refused during a load spike is soon served."
        ),
    )
    grammar_compile_queue: int = Field(
        default=16,
        ge=1,
        le=1024,
        description=(
            "Grammar compiles (cache misses) that may wait for one of the two grammar threads; past this, "
            "and past a quarter of it for one tenant, a structured-output request is refused at once (503). "
            "16 behind two threads at the ~0.1-0.3 s a largest-allowed schema takes is a wait of 1-3 s, well "
            "inside the default compile bound; a longer queue would mostly hold requests bound to time out."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if not self.lora_target_modules:
            raise ValueError("lora_target_modules must not be empty")
        if self.adapter_retry_max_s < self.adapter_retry_s:
            raise ValueError(
                f"adapter_retry_max_s ({self.adapter_retry_max_s}) must be >= adapter_retry_s "
                f"({self.adapter_retry_s})"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.name

    def page_rank_for(self, device_type: str) -> int:
        """The rank units of one adapter page on this device (see lora_page_rank)."""
        if self.lora_page_rank is not None:
            return min(self.lora_page_rank, self.max_lora_rank)
        return self.max_lora_rank if device_type == "cuda" else min(16, self.max_lora_rank)

    def pages_per_adapter(self, device_type: str) -> int:
        """Pages of an adapter of max_lora_rank."""
        return -(-self.max_lora_rank // self.page_rank_for(device_type))

    def torch_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> "torch.dtype":
        return self.dtype_choice()[0]

    def dtype_choice(self) -> "tuple[torch.dtype, str]":
        """The compute dtype and why it was chosen (logged at load)."""
        import torch

        if self.dtype != "auto":
            named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
            return named[self.dtype], "set in the config"
        if self.torch_device().type == "cuda":
            return torch.bfloat16, "auto: CUDA"
        cpu = cpu_features()
        if cpu.native_bf16:
            return torch.bfloat16, f"auto: the CPU has native bf16 ({', '.join(cpu.isa)})"
        return (
            torch.float32,
            f"auto: the CPU has no native bf16 ({', '.join(cpu.isa) or 'no AVX'}), fp32 is faster",
        )
