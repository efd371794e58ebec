"""The tier's and the model's policy over a planned request: what no engine of the model can serve, what
the tier does not allow, and the max_tokens a request gets when it asks for none. Checked before
admission, so that a request that cannot run reserves nothing."""

from dataclasses import dataclass, replace

from app.auth.authenticator import Principal
from app.completions.admission import concurrency_limit
from app.completions.plan import RequestPlan
from app.errors import InvalidParameter, TooManySequences
from deployments.engine.interface import SamplingParams


@dataclass(frozen=True)
class Allowed:
    """A plan as the policy lets it run."""

    params: SamplingParams  # max_tokens set where the tier caps it
    sequences: int  # what the engine runs for it: n per prompt
    output_tokens: int  # the most output it may produce, all sequences together


def allowed(plan: RequestPlan, principal: Principal) -> Allowed:
    check_context(plan)
    sequences = check_sequences(plan, principal)
    params = capped(plan, principal)
    room = plan.target.base.max_model_len - plan.longest_prompt
    most = params.max_tokens if params.max_tokens is not None else max(room, 0)
    return Allowed(params, sequences, sequences * most)


def check_context(plan: RequestPlan) -> None:
    """What no engine of this model can serve: a prompt that fills the context, or max_tokens past it."""
    context = plan.target.base.max_model_len
    prompts = plan.prompts
    for number, prompt in enumerate(prompts):
        if len(prompt) < context:
            continue
        which = f"prompt {number} of {len(prompts)}" if len(prompts) > 1 else "the prompt"
        message = (
            f"This model's context is {context} tokens; {which} has {len(prompt)} "
            "and leaves no room for output."
        )
        raise InvalidParameter(message, param=plan.prompt_param, code="context_length_exceeded")
    max_tokens = plan.params.max_tokens
    if max_tokens is not None and max_tokens > context:
        message = f"max_tokens {max_tokens} exceeds this model's context of {context} tokens."
        raise InvalidParameter(message, param="max_tokens", code="context_length_exceeded")


def check_sequences(plan: RequestPlan, principal: Principal) -> int:
    """The sequences the request runs (n per prompt), refused at once past what one request may run on
    this model (the engine's max_num_seqs) or past the tier's concurrency: no wait could make room."""
    n = plan.params.n
    sequences = n * len(plan.prompts)
    per_request = plan.target.base.spec.max_num_seqs
    limit = None
    if sequences > per_request:
        limit = f"one request runs at most {per_request} sequences on this model"
    elif sequences > (principal.limits.max_concurrent or sequences):
        limit = concurrency_limit(principal.limits, principal.tier)
    if limit is not None:
        raise TooManySequences(sequences, limit, n=n, prompts=len(plan.prompts))
    return sequences


def capped(plan: RequestPlan, principal: Principal) -> SamplingParams:
    """The tier's max_tokens cap: asking for more is an error; asking for nothing means the cap (or the
    API's own default, within the cap)."""
    params = plan.params
    cap = principal.limits.max_tokens_cap
    default = plan.default_max_tokens
    if params.max_tokens is None and default is not None:
        params = replace(params, max_tokens=min(default, cap or default))
    if cap is None:
        return params
    if params.max_tokens is not None and params.max_tokens > cap:
        message = f"max_tokens {params.max_tokens} exceeds the cap of {cap} for tier {principal.tier}"
        raise InvalidParameter(message, param="max_tokens", code="max_tokens_over_cap")
    if params.max_tokens is None:
        room = plan.target.base.max_model_len - plan.longest_prompt
        return replace(params, max_tokens=max(1, min(cap, room)))
    return params
