"""ModelRunner: turns a scheduled step into its inputs, runs the forward once, returns the logits needed.

The forward is ours (decoder_forward.py) for Llama-shaped models and HF's otherwise. A pure-decode step uses
its batch bucket's fixed inputs and, on CUDA, replays that bucket's captured graph; every other step is built
and run eagerly. Either way the step's metadata reaches the device in one copy (step_inputs.py).
"""

import logging

import torch

from deployments.engine.model.decode_graphs import DecodeGraphs
from deployments.engine.model.decoder_forward import DecoderForward, HFForward, unsupported_reason
from deployments.engine.model.kv_cache import KVCache
from deployments.engine.model.layer_ops import layer_ops_for
from deployments.engine.model.lora_layers import LoRAContext
from deployments.engine.model.model_loader import LoadedModel
from deployments.engine.model.step_inputs import StepInputs, StepInputsBuilder, is_pure_decode
from deployments.engine.sequence import ScheduledSequence

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCache,
        *,
        lora_pages: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        cuda_graphs: bool = True,
    ) -> None:
        self.device = loaded.device
        self.kv_cache = kv_cache
        self.lora_context: LoRAContext = loaded.lora_context
        reason = unsupported_reason(loaded.model)
        ops = layer_ops_for(self.device) if reason is None else None
        self.inputs = StepInputsBuilder(
            kv_cache,
            device=self.device,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            lora_pages=lora_pages,
            lora_run_pages=loaded.lora_run_pages,
            chunked=ops is not None and ops.paged_prefill,  # one attention launch per layer for any step
        )
        cuda = self.device.type == "cuda"
        self.forward: DecoderForward | HFForward
        if ops is not None:
            triton = ops.name == "triton"  # fused groups pay off with the Triton LoRA kernels (CUDA)
            self.forward = DecoderForward(
                loaded.model,
                kv_cache,
                ops,
                fuse=triton,
                group_lora=triton,
                max_positions=max_model_len,
                nf4_kernel=triton,  # bitsandbytes nf4 linears through our Triton GEMM (nf4_base.py)
            )
            if ops.name == "triton":
                self.lora_context.kernel_name = "triton_sgmv"
        else:
            log.info("running HF's forward: %s", reason)
            self.forward = HFForward(loaded.model)
        self.graphs: DecodeGraphs | None = None
        if cuda and cuda_graphs and isinstance(self.forward, DecoderForward):
            try:
                self.graphs = DecodeGraphs(self.forward, self.inputs, with_lora=bool(loaded.lora_modules))
            except Exception:  # e.g. a quantized kernel that cannot be captured: serve eagerly instead
                log.exception("capturing the decode graphs failed; decode steps run eagerly")
                torch.cuda.synchronize(self.device)
        log.info(
            "forward %s (%s), decode %s",
            self.forward.name,
            getattr(self.forward, "ops", None) and self.forward.ops.name,  # type: ignore[union-attr]
            "CUDA graphs per bucket " + str(self.inputs.buckets) if self.graphs else "eager",
        )

    @property
    def graph_pool_bytes(self) -> int:
        return 0 if self.graphs is None else self.graphs.pool_bytes

    @property
    def step_buffer_bytes(self) -> int:
        return self.inputs.nbytes

    def run(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Forward one step; returns logits [N, V] (float32): per scheduled sequence in order, the rows of
        its `prompt_positions` (prompt logprobs), then its sampling row if it `draws`."""
        inputs = self.prepare(scheduled)
        self.lora_context.batch = inputs.lora
        try:
            if self.graphs is not None and inputs.logits_index is None:
                logits = self.graphs.run(inputs)
            else:
                logits = self.forward(inputs)
        finally:
            self.lora_context.batch = None
        return logits[: inputs.num_rows].float()

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        if is_pure_decode(scheduled) and self.inputs.bucket_for(len(scheduled)) is not None:
            pad = self.graphs is not None or self.inputs.pad_cpu_buckets
            return self.inputs.decode(scheduled, pad=pad)
        return self.inputs.general(scheduled)
