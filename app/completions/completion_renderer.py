"""CompletionRenderer: a /v1/completions request's outputs as a Completion or its chunk stream; with
echo, each choice's prompt comes before its text (and its prompt's logprobs before its own)."""

from typing import Any

from app.completions.logprobs import CompletionLogprobsBuilder, join
from app.completions.rendering import Choice, ChoiceRenderer, finish_reason, sse, usage_block
from app.schemas.openai import Completion, CompletionChoice, CompletionLogprobs, Usage
from deployments.engine.interface import RequestOutput, TokenLogprob


class CompletionRenderer(ChoiceRenderer):
    def _new_choice(self, index: int) -> Choice:
        builder = CompletionLogprobsBuilder(self.texts) if self.shape.logprobs is not None else None
        return Choice(index, builder=builder)

    def _held_chars(self, choice: Choice | None, out: RequestOutput) -> int:
        """An echo's prompt rides on its choice's first piece."""
        if self.shape.echo is None or (choice is not None and choice.seen):
            return 0
        return len(self.shape.echo[out.index // self.shape.n])

    # -- whole responses --------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        choice = self._get(out.index)
        text, piece = self._piece(choice, out)
        self._took(choice, text)
        if piece is not None:
            choice.pieces.append(piece)
        if out.finish_reason is not None:
            choice.ended(out)

    def body(self, last: RequestOutput) -> dict[str, Any]:
        choices = []
        for index in range(self.total):
            choice = self._get(index)
            if not choice.seen and self.shape.echo is not None:  # no output at all: still its echo
                self.add(RequestOutput(request_id="", text="", index=index))
                choice.finish = None
            choices.append(
                CompletionChoice(
                    index=index,
                    text="".join(choice.text),
                    finish_reason=choice.finish,
                    logprobs=join(choice.pieces) if choice.builder is not None else None,
                    closing_forced=choice.forced,
                    gpu_time_limited=choice.gpu_limited,
                )
            )
        return Completion(
            id=self.request_id, model=self.model, choices=choices, usage=usage_block(last.usage)
        ).model_dump()

    def _piece(self, choice: Choice, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """The output's text and logprobs, with the prompt's in front on a choice's first output."""
        text = out.text
        token_ids: list[int] = []
        entries: list[TokenLogprob | None] = []
        if not choice.seen and self.shape.echo is not None:
            prompt = out.index // self.shape.n
            text = self.shape.echo[prompt] + text
            token_ids += self.prompts[prompt]
            given = out.prompt_logprobs or []
            entries += (
                given if len(given) == len(self.prompts[prompt]) else [None] * len(self.prompts[prompt])
            )
        if choice.builder is None:
            return text, None
        token_ids += out.token_ids
        logprobs = out.logprobs or []
        entries += logprobs if len(logprobs) == len(out.token_ids) else [None] * len(out.token_ids)
        return text, choice.builder.add(token_ids, entries)

    # -- streams -----------------------------------------------------------------------------------

    def events(self, out: RequestOutput) -> list[str]:
        choice = self._get(out.index)
        text, piece = self._piece(choice, out)
        choice.seen = True
        ended = out.finish_reason is not None
        if not (text or piece is not None or ended or out.finished):
            return []
        shaped = CompletionChoice(
            index=out.index,
            text=text,
            finish_reason=finish_reason(out) if ended else None,
            logprobs=piece,
            closing_forced=out.closing_forced or None,
            gpu_time_limited=out.gpu_limited or None,
        )
        return [sse(self._envelope([shaped], self._usage_so_far(out)))]

    def _envelope(self, choices: list[Any], usage: Usage | None) -> dict[str, Any]:
        return Completion(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump()
