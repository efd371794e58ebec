"""ResponsesConfig: how long stored responses are kept and how large a stored conversation may grow."""

from pydantic import BaseModel, Field


class ResponsesConfig(BaseModel):
    """Settings.responses, as JSON in LORAPLEX_RESPONSES: {"retention_days": 30, ...}."""

    retention_days: float = Field(
        default=30.0,
        gt=0,
        description=(
            "A stored response (store: true) can be retrieved and continued this long after it was made; "
            "then it is gone as if deleted."
        ),
    )
    max_stored_kb: int = Field(
        default=4096,
        ge=1,
        description=(
            "Largest conversation one stored response may hold (its chain of earlier turns, its input and "
            "its output, as JSON). A continuation past it drops its oldest turns with truncation 'auto' "
            "and is refused (400) with 'disabled'."
        ),
    )
    max_input_items: int = Field(default=1024, ge=1, description="Most items in one request's `input` list.")
