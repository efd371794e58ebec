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
    ids = torch.tensor(list(chosen), dtype=torch.long, device=logits.device)
    table = logprob_table(logits, ids, max(top, default=0))
    return read_logprobs(table.tolist(), list(chosen), top)


def logprob_table(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """[R, 1 + 2k] float64 on the logits' device: each row's logprob of chosen[r], then its k best logprobs,
    then their token ids (exact in float64), so one read brings them to the host with anything else."""
    with torch.inference_mode():
        lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        picked = lp.gather(1, chosen.long()[:, None])  # [R, 1]
        if k <= 0:
            return picked.double()
        values, indices = lp.topk(k, dim=-1)  # [R, k], best first
        return torch.cat([picked.double(), values.double(), indices.double()], dim=1)


def read_logprobs(rows: list[list[float]], chosen: Seq[int], top: Seq[int]) -> list[TokenLogprob]:
    """TokenLogprobs from `logprob_table` rows read back to the host."""
    k = (len(rows[0]) - 1) // 2 if rows else 0
    out = []
    for r, token in enumerate(chosen):
        row = rows[r]
        n = top[r]
        alternatives = tuple((int(row[1 + k + j]), float(row[1 + j])) for j in range(n))
        out.append(TokenLogprob(int(token), float(row[0]), alternatives))
    return out
