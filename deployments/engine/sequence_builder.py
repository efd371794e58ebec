"""SequenceBuilder: a request's own input validated and turned into its sequences, one per (prompt, choice).

It reads only the engine's fixed limits (vocabulary, context, queue size), so any thread may call it and a
caller gets a named error before anything is queued; what depends on the engine's state (queue share, the
adapter's residency) is the loop thread's business.
"""

import torch

from deployments.engine.errors import EmptyPrompt, InvalidRequest, PromptTooLong
from deployments.engine.request import EngineRequest
from deployments.engine.sequence import Sequence


class SequenceBuilder:
    def __init__(
        self, *, vocab_size: int, max_model_len: int, max_waiting: int, device: torch.device
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.device = device

    def build(self, request: EngineRequest) -> list[Sequence]:
        params = request.params
        for token, _ in params.logit_bias:
            if token >= self.vocab_size:
                raise InvalidRequest(
                    f"logit_bias names token {token}; the vocabulary has {self.vocab_size}",
                    param="logit_bias",
                )
        if any(token >= self.vocab_size for token in params.stop_token_ids):
            raise InvalidRequest(
                f"stop_token_ids must be token ids below {self.vocab_size}", param="stop_token_ids"
            )
        if request.max_gpu_ms is not None and not request.max_gpu_ms > 0:
            raise InvalidRequest("max_gpu_ms must be positive", param="max_gpu_ms")
        seqs: list[Sequence] = []
        for p, prompt_ids in enumerate(request.prompts):
            if not prompt_ids:
                raise EmptyPrompt()
            if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
                raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
            n = len(prompt_ids)
            room = self.max_model_len - n
            if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
                raise PromptTooLong(n, params.max_tokens or 1, self.max_model_len)
            leader: Sequence | None = None
            for j in range(params.n):
                index = p * params.n + j
                generator = None
                if params.seed is not None:  # each choice its own stream: seed, seed + 1, ...
                    seed = (params.seed + j) % 2**63
                    generator = torch.Generator(device=self.device).manual_seed(seed)
                seq = Sequence(
                    request_id=request.request_id if index == 0 else f"{request.request_id}#{index}",
                    group_id=request.request_id,
                    index=index,
                    leader=leader,
                    prompt_ids=list(prompt_ids),
                    params=params,
                    adapter=request.adapter,
                    max_tokens=room if params.max_tokens is None else params.max_tokens,
                    generator=generator,
                    cache_salt=request.cache_salt,
                    tenant=request.tenant,
                    max_gpu_ms=request.max_gpu_ms,
                    tenant_weight=request.tenant_weight,
                    batch=request.priority == "batch",
                    # The leader computes the prompt's logprobs; its other choices report them and
                    # prefill from its cached blocks instead of recomputing every position.
                    prompt_logprobs=None if params.prompt_logprobs is None or leader else [None],
                )
                leader = leader or seq
                seqs.append(seq)
        if len(seqs) > self.max_waiting:
            raise InvalidRequest(
                f"{len(seqs)} choices exceed the engine's queue of {self.max_waiting}", param="n"
            )
        return seqs
