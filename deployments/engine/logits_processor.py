"""LogitsProcessor: a step's logits in, a token (and its logprobs) per sampling row out.

What happens between the forward and the tokens: prompt logprobs are taken from the rows at prompt positions,
logit biases and grammar masks are applied in place to the rows whose requests have them (a grammar may
steer its row to a token of its closing when the budget runs low: see GrammarMatcher), the sampler applies
penalties and draws, and each token's logprobs come from the raw logits. Tokens and logprobs come back to the
host in one read, the step's one device->host sync. A row that cannot be sampled (bad parameters, a token its
grammar refuses) gets its error instead of a token, so it fails alone.
"""

import logging
import time

import torch

from deployments.engine.logprobs import logprob_table, read_logprobs, token_logprobs
from deployments.engine.outputs import TokenLogprob
from deployments.engine.sampler import Sampler, SamplingRow
from deployments.engine.sequence import ScheduledSequence, Sequence

log = logging.getLogger(__name__)
Token = int | str  # a sampled token, or why the row could not be sampled


class LogitsProcessor:
    def __init__(
        self, sampler: Sampler, vocab_size: int, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))

    def take_prompt_logprobs(
        self, logits: torch.Tensor, scheduled: list[ScheduledSequence], prompt_rows: list[range]
    ) -> torch.Tensor:
        """Record the prompt logprobs in `logits` (ModelRunner.run's row order); return the sampling rows."""
        row = 0
        sampling_rows: list[int] = []
        for item, positions in zip(scheduled, prompt_rows, strict=True):
            if positions:
                seq = item.seq
                assert seq.prompt_logprobs is not None and seq.params.prompt_logprobs is not None
                start = time.perf_counter()
                chosen = [seq.token_ids[q + 1] for q in positions]
                top = [seq.params.prompt_logprobs] * len(positions)
                seq.prompt_logprobs += token_logprobs(logits[row : row + len(positions)], chosen, top)
                seq.metrics.step_host_time += time.perf_counter() - start
                row += len(positions)
            if item.draws:
                sampling_rows.append(row)
                row += 1
        return logits[sampling_rows]

    def sample(
        self, logits: torch.Tensor, sampling: list[ScheduledSequence]
    ) -> tuple[list[Token], list[TokenLogprob | None]]:
        """A token per row (or its error) and each token's logprobs where its request asked. Logprobs read the
        raw logits; biases and grammar masks then change only the rows that use them. The per-row retry runs
        only after a failure (a seeded row may then draw from a generator the failed batch call advanced)."""
        asked = [i for i, s in enumerate(sampling) if s.seq.params.logprobs is not None]
        raw = logits[asked] if asked else None  # [A, V]: a copy (list indexing), before biases and masks
        self.constrain(logits, sampling)
        rows = [sampling_row(s.seq) for s in sampling]
        table: list[list[float]] = []
        try:
            tokens, table = self._draw(logits, rows, raw, asked, sampling)
        except Exception:
            log.exception("sampling the step failed; sampling its rows one by one")
            tokens = self._draw_each(logits, rows)
        replaced: set[int] = set()  # rows whose grammar took a closing token in place of the one sampled
        for i, s in enumerate(sampling):  # advance the grammars; a refused token fails only its request
            token, matcher = tokens[i], s.seq.matcher
            if matcher is None or isinstance(token, str):
                continue
            start = time.perf_counter()
            taken = matcher.take(token, _left(s.seq) - 1)
            s.seq.metrics.step_host_time += time.perf_counter() - start
            if taken is None:
                tokens[i] = f"token {token} is outside the request's grammar"
            elif taken != token:
                tokens[i] = taken
                replaced.add(i)
        return tokens, self._logprobs(tokens, raw, asked, table, sampling, replaced)

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        raw: torch.Tensor | None,
        asked: list[int],
        sampling: list[ScheduledSequence],
    ) -> tuple[list[Token], list[list[float]]]:
        """The whole batch in one sampler call; tokens and logprob rows read back together."""
        chosen = self.sampler.sample_on_device(logits, rows)  # [N] on the device
        fetch = [chosen.double()]
        if raw is not None:
            k = max(sampling[i].seq.params.logprobs or 0 for i in asked)
            fetch.append(logprob_table(raw, chosen[asked], k).flatten())
        flat: list[float] = torch.cat(fetch).tolist()  # the one read back
        tokens: list[Token] = [int(t) for t in flat[: len(rows)]]
        table: list[list[float]] = []
        if raw is not None:
            width = (len(flat) - len(rows)) // len(asked)
            table = [flat[len(rows) + r * width : len(rows) + (r + 1) * width] for r in range(len(asked))]
        return tokens, table

    def _draw_each(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[Token]:
        tokens: list[Token] = []
        for i, row in enumerate(rows):
            try:
                tokens.append(self.sampler.sample(logits[i : i + 1], [row])[0])
            except Exception as error:
                tokens.append(str(error) or type(error).__name__)
        return tokens

    @staticmethod
    def _logprobs(
        tokens: list[Token],
        raw: torch.Tensor | None,
        asked: list[int],
        table: list[list[float]],
        sampling: list[ScheduledSequence],
        replaced: set[int],
    ) -> list[TokenLogprob | None]:
        logprobs: list[TokenLogprob | None] = [None] * len(sampling)
        good = [i for i in asked if not isinstance(tokens[i], str)]
        if raw is None or not good:
            return logprobs
        # The table read back holds the sampled tokens' rows: a row whose token was replaced (or every row,
        # when the batch call failed) gets its logprobs from the raw logits now.
        read = [i for i in good if table and i not in replaced]
        late = [i for i in good if i not in read]
        for rows, from_table in ((read, True), (late, False)):
            if not rows:
                continue
            chosen = [int(tokens[i]) for i in rows]
            top = [sampling[i].seq.params.logprobs or 0 for i in rows]
            if from_table:
                found = read_logprobs([table[asked.index(i)] for i in rows], chosen, top)
            else:
                found = token_logprobs(raw[[asked.index(i) for i in rows]], chosen, top)
            for i, lp in zip(rows, found, strict=True):
                logprobs[i] = lp
        return logprobs

    @torch.inference_mode()
    def constrain(self, logits: torch.Tensor, sampling: list[ScheduledSequence]) -> None:
        """Apply logit biases, min_tokens' bans and grammar masks, in place, to the rows that have them."""
        for i, s in enumerate(sampling):
            params = s.seq.params
            if params.logit_bias:
                ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=logits.device)
                values = torch.tensor(
                    [b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device
                )
                logits[i].index_add_(0, ids, values)
            if s.seq.num_output_tokens < params.min_tokens:
                self._ban_stops(
                    logits, i, params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
                )
        masked = [i for i, s in enumerate(sampling) if s.seq.matcher is not None]
        if not masked:
            return
        from deployments.engine.grammar.compiler import new_bitmask, unpack_bitmask

        bitmask = new_bitmask(len(masked), self.vocab_size)  # [M, ceil(V / 32)] int32, built on the host
        for r, i in enumerate(masked):
            seq = sampling[i].seq
            assert seq.matcher is not None
            start = time.perf_counter()
            seq.matcher.fill_mask(bitmask, r, _left(seq))
            seq.metrics.step_host_time += time.perf_counter() - start
        index = torch.tensor(masked, dtype=torch.long, device=logits.device)
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])  # [M, V]
        rows = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, index, rows)  # masks applied on the logits' device: nothing read back

    @staticmethod
    def _ban_stops(logits: torch.Tensor, row: int, tokens: tuple[int, ...]) -> None:
        """vLLM's min_tokens: a token that would end the choice cannot be drawn before it has that many.
        Ids past the logits (a stop id the route did not check) are left out rather than fail the batch."""
        ids = [t for t in tokens if t < logits.shape[1]]
        if ids:
            logits[row, torch.tensor(ids, dtype=torch.long, device=logits.device)] = float("-inf")


def _left(seq: Sequence) -> int:
    """Tokens the sequence may still produce, the one sampled this step included."""
    return seq.max_tokens - seq.num_output_tokens


def sampling_row(seq: Sequence) -> SamplingRow:
    """One sequence's view of a step for the sampler; the histories only when penalties read them."""
    penalised = seq.params.uses_penalties
    return SamplingRow(
        params=seq.params,
        generator=seq.generator,
        prompt_ids=seq.prompt_ids if penalised else (),
        output_ids=seq.output_ids if penalised else (),
    )
