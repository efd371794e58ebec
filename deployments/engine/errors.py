"""Engine domain errors. app/errors.py alone turns them into HTTP responses."""

from adapters.errors import AdapterError, DomainError


class EngineError(DomainError):
    """Base class for errors raised by the engine API."""


class InvalidRequest(EngineError):
    """The request itself is wrong (the caller can fix it); the engine keeps serving others."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EmptyPrompt(InvalidRequest):
    def __init__(self) -> None:
        super().__init__("prompt is empty: at least one token is required", param="prompt")


class PromptTooLong(InvalidRequest):
    def __init__(
        self, prompt_tokens: int, max_tokens: int, max_model_len: int, *, param: str = "prompt"
    ) -> None:
        super().__init__(
            f"prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}, but the model's context "
            f"is {max_model_len} tokens",
            param=param,
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len

    def for_param(self, param: str) -> "PromptTooLong":
        """The same error, naming the request field the prompt came from (chat calls it `messages`)."""
        return PromptTooLong(self.prompt_tokens, self.max_tokens, self.max_model_len, param=param)


class BudgetTooSmall(InvalidRequest):
    """A structured output cannot complete within the request's max_tokens: its shortest known completion
    (the stop token included) is longer. Refused before any token is generated."""

    def __init__(self, max_tokens: int, minimum: int) -> None:
        super().__init__(
            f"max_tokens is {max_tokens}, but this response format needs at least {minimum} tokens to "
            f"complete; set max_tokens to {minimum} or more",
            param="max_tokens",
        )
        self.max_tokens = max_tokens
        self.minimum = minimum


class InvalidSamplingParams(InvalidRequest):
    """A sampling value is out of range; the message names the value and its limit."""


class DuplicateRequestId(InvalidRequest):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already running", param=None)


class EngineStopped(EngineError):
    """The engine loop is not running (shut down, or it failed)."""


class RequestFailed(EngineError):
    """The engine could not finish this request (its step, its sampling or its bookkeeping failed) and
    goes on serving the others. Why is in the engine's log under the request id, never in this error: it
    reaches the tenant."""

    def __init__(self, what: str = "the engine failed while serving this request") -> None:
        super().__init__(what)


# What ends a request that the engine had accepted (RequestOutput.error): its own failure, or its adapter's.
RequestError = EngineError | AdapterError


class EngineOverloaded(EngineError):
    """The waiting queue is full; the caller should retry later or on another replica."""


class QueueShareExceeded(EngineOverloaded):
    """While others wait, one party's sequences may fill at most half of the waiting queue: this request
    would take its party past that. The caller should retry later (or on another replica)."""


class ReplicaLost(EngineStopped):
    """The engine replica serving a request died (or became unreachable) after the request had started
    delivering output elsewhere than a retry could hide."""

    def __init__(self, request_id: str, delivered_tokens: int) -> None:
        super().__init__(
            f"the engine replica serving request {request_id} stopped after {delivered_tokens} generated "
            "tokens; retry the request"
        )
        self.request_id = request_id
        self.delivered_tokens = delivered_tokens
