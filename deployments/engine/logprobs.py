"""Token log-probabilities under a request's own model (base or adapter): the log-softmax of its raw logits.

Computed only for the rows whose requests asked, so a batch's other requests pay nothing. Prompt logprobs
(completions' `echo`) need the logits of every prompt position, not just the last: `prompt_positions`
names the positions of a step's chunk that the model runner keeps for them.
"""

from collections.abc import Sequence as Seq

import torch

from deployments.engine.outputs import TokenLogprob
from deployments.engine.sequence import Sequence


def prompt_positions(seq: Sequence, start: int, num_tokens: int) -> range:
    """Positions in the chunk [start, start + num_tokens) whose logits give prompt logprobs still missing.
    Position q's logits predict token q + 1, so the prompt's last position is never among them."""
    if not seq.collects_prompt_logprobs:
        return range(0)
    assert seq.prompt_logprobs is not None
    first = max(start, len(seq.prompt_logprobs) - 1)  # entry 0 is the first token's None
    return range(first, max(first, min(start + num_tokens, seq.num_prompt_tokens - 1)))


def token_logprobs(logits: torch.Tensor, chosen: Seq[int], top: Seq[int]) -> list[TokenLogprob]:
    """logits [R, V]: row r's logprob of chosen[r] and its top[r] most likely tokens."""
    with torch.inference_mode():
        lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        ids = torch.tensor(list(chosen), dtype=torch.long, device=lp.device)[:, None]  # [R, 1]
        picked = lp.gather(1, ids).squeeze(1).tolist()
        k = max(top, default=0)
        best_values: list[list[float]] = []
        best_ids: list[list[int]] = []
        if k > 0:
            values, indices = lp.topk(k, dim=-1)  # [R, k], best first
            best_values, best_ids = values.tolist(), indices.tolist()
    out = []
    for r, token in enumerate(chosen):
        alternatives = (
            () if not top[r] else tuple(zip(best_ids[r][: top[r]], best_values[r][: top[r]], strict=True))
        )
        out.append(TokenLogprob(int(token), float(picked[r]), alternatives))
    return out
