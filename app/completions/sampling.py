"""What a request asks of the engine beyond its prompt: sampling, logit_bias and structured output,
read from the OpenAI fields (and vLLM's extensions, app/schemas/extensions.py)."""

import json
from typing import Any

from app.errors import InvalidParameter
from app.schemas.extensions import sampling_extensions
from app.schemas.openai import (
    ResponseFormat,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingFields,
)
from deployments.engine.interface import SamplingParams, StructuredOutput

ANY_OBJECT = '{"type": "object"}'


def sampling_params(
    body: SamplingFields, max_tokens: int | None, *, vocab_size: int, **more: Any
) -> SamplingParams:
    """OpenAI defaults where the request is silent (temperature 1, top_p 1); vLLM's extensions as
    app/schemas/extensions.py reads them; `more` sets the rest (n, logprobs, logit_bias, structured output),
    which each API reads from its own fields."""
    extensions = sampling_extensions(
        body, vocab_size=vocab_size, max_tokens=max_tokens, structured=more.get("structured") is not None
    )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        stop=tuple(body.stop_list),
        **extensions,
        **more,
    )


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's token id -> bias map, checked against the base model's tokenizer."""
    entries = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else -1
        if not 0 <= token < vocab_size:
            message = f"logit_bias keys must be token ids from 0 to {vocab_size - 1}; got {key[:32]!r}"
            raise InvalidParameter(message, param="logit_bias")
        entries.append((token, float(value)))
    return tuple(sorted(entries))


def structured_output(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """response_format as the engine's grammar: any JSON object, or the given schema."""
    if isinstance(response_format, ResponseFormatJsonObject):
        return StructuredOutput(json_schema=ANY_OBJECT, param="response_format")
    if isinstance(response_format, ResponseFormatJsonSchema):
        schema = response_format.json_schema.schema_
        text = ANY_OBJECT if schema is None else json.dumps(schema, ensure_ascii=False)
        return StructuredOutput(json_schema=text, param="response_format")
    return None
