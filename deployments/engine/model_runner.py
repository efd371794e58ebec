"""ModelRunner: turns a scheduled step into packed tensors, runs the model once, returns the logits needed.

All index tensors are built on the host with vectorised torch ops (no per-layer or per-module host
syncs) and copied to the device once per step; attention and LoRA read them from the step metadata.
"""

from dataclasses import dataclass

import torch

from deployments.engine.attention import METADATA_KWARG, AttentionMetadata, PrefillSpan
from deployments.engine.kv_cache import KVCache
from deployments.engine.logprobs import prompt_positions
from deployments.engine.lora_kernels import LoRABatch
from deployments.engine.lora_layers import LoRAContext
from deployments.engine.model_loader import LoadedModel
from deployments.engine.scheduler import ScheduledSequence


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    logits_index: torch.Tensor  # [N] packed positions whose logits are sampled
    attention: AttentionMetadata
    lora: LoRABatch | None


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv_cache: KVCache, *, max_loras: int) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_loras = max_loras
        self.lora_context: LoRAContext = loaded.lora_context

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Forward one step; returns logits [N, V] (float32): per scheduled sequence in order, the rows of
        its `prompt_positions` (prompt logprobs), then its sampling row if it `draws`."""
        inputs = self.prepare(scheduled)
        self.lora_context.batch = inputs.lora
        try:
            out = self.model(
                input_ids=inputs.input_ids,
                position_ids=inputs.positions,
                use_cache=False,
                logits_to_keep=inputs.logits_index,
                **{METADATA_KWARG: inputs.attention},
            )
        finally:
            self.lora_context.batch = None
        logits: torch.Tensor = out.logits[0]
        return logits.float()

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        starts: list[int] = []  # per sequence: first computed position
        lengths: list[int] = []
        tables: list[list[int]] = []
        for item in scheduled:
            seq = item.seq
            ids.extend(seq.token_ids[seq.num_computed : seq.num_computed + item.num_tokens])
            starts.append(seq.num_computed)
            lengths.append(item.num_tokens)
            tables.append(seq.block_table)
        lens = torch.tensor(lengths)
        seq_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), lens)  # [T]
        token_start = torch.cumsum(lens, 0) - lens  # [S] first packed index of each sequence
        positions = torch.tensor(starts)[seq_of_token] + torch.arange(len(ids)) - token_start[seq_of_token]
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [S, max_blocks]
        slot_mapping = table[seq_of_token, positions // bs] * bs + positions % bs  # [T]

        decode_rows = [i for i, n in enumerate(lengths) if n == 1]
        decode_token_index = decode_block_table = decode_context_lens = None
        if decode_rows:
            rows = torch.tensor(decode_rows)
            decode_context_lens = torch.tensor(starts)[rows] + 1  # context includes the new token
            used_blocks = -(-int(decode_context_lens.max()) // bs)
            decode_block_table = table[rows, :used_blocks]  # padding is block 0; the mask hides it
            decode_token_index = token_start[rows]

        prefills: list[PrefillSpan] = []
        for i, n in enumerate(lengths):
            if n == 1:
                continue
            context_len = starts[i] + n
            blocks = None
            if starts[i] > 0:
                blocks = table[i, : -(-context_len // bs)].to(self.device)
            prefills.append(PrefillSpan(int(token_start[i]), n, context_len, blocks))

        logits_index: list[int] = []
        for i, item in enumerate(scheduled):
            first = int(token_start[i])
            logits_index.extend(
                first + q - starts[i] for q in prompt_positions(item.seq, starts[i], lengths[i])
            )
            if item.draws:
                logits_index.append(first + lengths[i] - 1)
        dev = self.device
        attention = AttentionMetadata(
            kv_caches=self.kv_cache.layers,
            block_size=bs,
            slot_mapping=slot_mapping.to(dev),
            decode_token_index=None if decode_token_index is None else decode_token_index.to(dev),
            decode_block_table=None if decode_block_table is None else decode_block_table.to(dev),
            decode_context_lens=None if decode_context_lens is None else decode_context_lens.to(dev),
            prefills=prefills,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, device=dev)[None],
            positions=positions.to(dev)[None],
            logits_index=torch.tensor(logits_index, dtype=torch.long, device=dev),  # may be empty
            attention=attention,
            lora=self._lora_batch(scheduled, lengths),
        )

    def _lora_batch(self, scheduled: list[ScheduledSequence], lengths: list[int]) -> LoRABatch | None:
        """Segments of tokens per slot; the scheduler already sorted sequences by slot, base last."""
        ends = [0] * self.max_loras
        segments: list[tuple[int, int, int]] = []
        cursor = 0
        for item, n in zip(scheduled, lengths, strict=True):
            slot = item.seq.slot
            if slot < 0:
                break  # base-model sequences come last
            if segments and segments[-1][0] == slot:
                segments[-1] = (slot, segments[-1][1], cursor + n)
            else:
                segments.append((slot, cursor, cursor + n))
            cursor += n
        if not segments:
            return None
        end_of = {slot: end for slot, _, end in segments}
        running_end = 0
        for slot in range(self.max_loras):  # cumulative ends, empty groups included, as grouped_mm wants
            running_end = end_of.get(slot, running_end)
            ends[slot] = running_end
        offsets = torch.tensor(ends, dtype=torch.int32, device=self.device)
        return LoRABatch(
            num_lora_tokens=cursor,
            offsets=offsets,
            segments=segments,
            segment_table=torch.tensor(segments, dtype=torch.int64),
        )
