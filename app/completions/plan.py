"""RequestPlan: a chat or completions request checked, templated and tokenised: what its lifecycle runs.

Prompt size is bounded before any work (Settings.max_messages, max_prompt_chars, max_prompts; a token id
counts as a character), and templating and tokenisation run in the thread pool once a prompt is large
enough to hold the event loop other requests share. /v1/responses plans its request as a chat request.
"""

from dataclasses import dataclass
from typing import Literal

from starlette.concurrency import run_in_threadpool

from app.auth.authenticator import Principal
from app.completions import tool_calls
from app.completions.reasoning import thinking_switch
from app.completions.sampling import logit_bias, sampling_params, structured_output
from app.errors import InvalidParameter
from app.schemas.openai import ChatCompletionRequest, CompletionRequest
from app.served_models.chat_format import HERMES, ToolFormat
from app.served_models.prompts import PromptBuilder
from app.services import Services, Target
from app.settings import Settings
from deployments.engine.interface import SamplingParams

# Below this many characters a prompt is templated and tokenised on the event loop: well under a
# millisecond (a short chat: ~0.3 ms), about what the hop to a thread and back costs.
INLINE_PROMPT_CHARS = 2048
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI


@dataclass(frozen=True)
class Shape:
    """What the response carries beyond text, as the request asked for it."""

    n: int = 1  # choices per prompt
    logprobs: int | None = None  # None: no logprobs; else with this many top alternatives
    echo: tuple[str, ...] | None = None  # /v1/completions echo: each prompt's text, before its completion
    tool_names: frozenset[str] = frozenset()  # chat: the output is parsed for calls of these tools
    tool_format: ToolFormat = HERMES  # how the model writes them
    reasoning: bool = False  # chat of a thinking model: the output is split into reasoning and content
    opened: bool = False  # the prompt opened <think>: the output starts as reasoning


@dataclass(frozen=True)
class RequestPlan:
    """One request, ready to run: its model, prompts (one, or a /v1/completions list; each with
    params.n choices), what the engine is asked, and what the response carries."""

    target: Target
    prompts: list[list[int]]
    params: SamplingParams
    shape: Shape
    prompt_param: Literal["messages", "prompt"]  # the field a prompt error names
    default_max_tokens: int | None = None  # without max_tokens: None runs to the context's end

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def longest_prompt(self) -> int:
        return max(len(p) for p in self.prompts)


async def plan_chat(body: ChatCompletionRequest, principal: Principal, services: Services) -> RequestPlan:
    """Bounds, tools, structured output and the template, as /v1/chat/completions (and /v1/responses,
    which runs as a chat request) check and apply them."""
    settings = services.settings
    limit = settings.max_messages
    if len(body.messages) > limit:
        message = f"{len(body.messages):,} messages were sent; at most {limit:,} are accepted."
        raise InvalidParameter(message, param="messages", code="too_many_messages")
    chars = _check_prompt_size(settings, "messages", [m.size() for m in body.messages])
    _check_n(settings, body.n)
    tools = tool_calls.plan(body)  # checked before the model is looked up, as every request field
    target = await services.resolve(principal, body.model)
    prompts = target.base.prompts
    fmt = prompts.format
    if tools.fmt != fmt.tools:  # the model writes calls in its own format
        tools = tool_calls.plan(body, fmt.tools)
    structured = tools.structured or structured_output(body.response_format)
    thinking = thinking_switch(body, fmt.thinks, structured is not None and not structured.triggered)
    bias = logit_bias(body.logit_bias, prompts.vocab_size)
    if chars < INLINE_PROMPT_CHARS and not tools.tools:
        prompt = prompts.chat_prompt(body.messages, tools.tools, thinking)
    else:
        prompt = await run_in_threadpool(prompts.chat_prompt, body.messages, tools.tools, thinking)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        body,
        body.output_limit,
        vocab_size=prompts.vocab_size,
        n=body.n,
        logprobs=logprobs,
        logit_bias=bias,
        structured=structured,
    )
    shape = Shape(
        n=body.n,
        logprobs=logprobs,
        tool_names=tools.names,
        tool_format=tools.fmt,
        reasoning=fmt.thinks and thinking is not False,
        opened=prompt.opened,
    )
    return RequestPlan(target, [prompt.ids], params, shape, "messages")


async def plan_completion(body: CompletionRequest, principal: Principal, services: Services) -> RequestPlan:
    """Bounds, echo, prompt log-probabilities and tokenisation, as /v1/completions checks and applies them."""
    settings = services.settings
    texts = body.prompts
    if len(texts) > settings.max_prompts:
        message = f"{len(texts):,} prompts were sent; at most {settings.max_prompts:,} are accepted."
        raise InvalidParameter(message, param="prompt", code="too_many_prompts")
    unit = "characters" if isinstance(texts[0], str) else "token ids"
    chars = _check_prompt_size(settings, "prompt", [len(p) for p in texts], unit)
    _check_n(settings, body.n)
    if body.max_tokens == 0 and not body.echo:
        message = "max_tokens may be 0 only with echo (for the prompt's log-probabilities)."
        raise InvalidParameter(message, param="max_tokens")
    target = await services.resolve(principal, body.model)
    prompts = target.base.prompts
    bias = logit_bias(body.logit_bias, prompts.vocab_size)
    if chars < INLINE_PROMPT_CHARS:
        prompt_ids = prompts.completions(texts)
    else:
        prompt_ids = await run_in_threadpool(prompts.completions, texts)
    echo = await run_in_threadpool(_echoes, prompts, texts) if body.echo else None
    prompt_logprobs = None
    if body.echo and (body.logprobs is not None or body.max_tokens == 0):
        prompt_logprobs = body.logprobs or 0  # max_tokens 0 asks for the prompt's logprobs alone
    params = sampling_params(
        body,
        body.output_limit,
        vocab_size=prompts.vocab_size,
        n=body.n,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=bias,
        structured=structured_output(body.response_format),
    )
    shape = Shape(n=body.n, logprobs=body.logprobs, echo=echo)
    return RequestPlan(target, prompt_ids, params, shape, "prompt", COMPLETIONS_MAX_TOKENS)


def _check_prompt_size(settings: Settings, param: str, sizes: list[int], unit: str = "characters") -> int:
    """Text is bounded by its characters; token ids meet the same bound, an id for a character (a token
    is at least one character of text, so ids never buy a longer prompt than text could)."""
    chars = sum(sizes)
    if chars > settings.max_prompt_chars:
        message = f"The prompt has {chars:,} {unit}; at most {settings.max_prompt_chars:,} are accepted."
        raise InvalidParameter(message, param=param, code="prompt_too_large")
    return chars


def _check_n(settings: Settings, n: int) -> None:
    if n > settings.max_n:
        raise InvalidParameter(
            f"n is {n}; at most {settings.max_n} choices are served per prompt.", param="n"
        )


def _echoes(prompts: PromptBuilder, texts: list[str] | list[list[int]]) -> tuple[str, ...]:
    return tuple(p if isinstance(p, str) else prompts.decode(p) for p in texts)
