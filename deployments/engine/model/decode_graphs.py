"""DecodeGraphs: a pure-decode step's forward captured once per batch bucket in a CUDA graph, then replayed.

A decode step of B sequences is a few hundred small kernels; launched from Python they cost ~10x their GPU
time. Captured, a step is one replay. Each bucket (step_inputs.decode_buckets) is captured twice, without and
with adapters (a base-only batch launches no LoRA kernels), on the bucket's fixed input views, largest first,
sharing one memory pool. Replay reads whatever the step wrote into those views; adapter slots and the KV
cache are written in place, so nothing is ever re-captured. Prefill and mixed steps stay eager: their shapes
change every step (chunk lengths, context spans), and they are few and compute-bound.
"""

import logging
import time
from collections.abc import Callable

import torch

from deployments.engine.model.lora_kernels import LoRABatch
from deployments.engine.model.step_inputs import StepInputs, StepInputsBuilder

log = logging.getLogger(__name__)
Forward = Callable[[StepInputs], torch.Tensor]


class DecodeGraphs:
    def __init__(self, forward: Forward, builder: StepInputsBuilder, *, with_lora: bool) -> None:
        self._forward = forward
        self._builder = builder
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = 0
        self.capture_seconds = 0.0
        self._capture(with_lora)

    def _capture(self, with_lora: bool) -> None:
        device = self._builder.device
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        for bucket in reversed(self._builder.buckets):  # largest first: the smaller ones reuse its pool
            inputs = self._builder.bucket_inputs(bucket)
            for lora in (False, True) if with_lora else (False,):
                self._prepare(inputs, lora)
                stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # warm up outside the graph (allocator, kernel autotuning)
                    self._forward(inputs)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(inputs)
                self._graphs[(bucket, lora)] = (graph, logits)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_allocated(device) - before
        log.info(
            "captured %d decode graphs (buckets %s) in %.1f s, %.1f MiB",
            len(self._graphs),
            self._builder.buckets,
            self.capture_seconds,
            self.pool_bytes / 2**20,
        )

    def _prepare(self, inputs: StepInputs, lora: bool) -> None:
        """Valid contents for a capture: every row a padding row (the sink), every token on slot 0."""
        b = inputs.input_ids.shape[0]
        attention = inputs.attention
        assert attention.decode_block_table is not None and attention.decode_context_lens is not None
        inputs.input_ids.zero_()
        inputs.positions.zero_()
        sink = self._builder.kv_cache.num_blocks
        inputs.slot_mapping.fill_(sink * self._builder.block_size)
        attention.decode_context_lens.fill_(1)
        attention.decode_block_table.fill_(sink)
        inputs.lora_ends.fill_(b if lora else 0)
        inputs.lora_runs.fill_(1)
        inputs.lora = (
            LoRABatch(
                b,
                inputs.lora_ends,
                [(0, 0, b)],
                torch.empty(0, 3, dtype=torch.int64),
                runs=inputs.lora_runs,
                max_pages=self._builder.lora_run_pages,
            )
            if lora
            else None
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the graph for this step's bucket; logits [B, V] of every bucket row (real rows first)."""
        bucket = inputs.input_ids.shape[0]
        graph, logits = self._graphs[(bucket, inputs.lora is not None)]
        graph.replay()
        return logits
