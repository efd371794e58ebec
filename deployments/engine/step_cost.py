"""StepCost: what a step's tokens cost in time on this replica, learnt from its own steps, so the batch class
takes what interactive work can spare here rather than a count tuned on one machine.

A step's timed part (the forward and the sampling) is fitted as `fixed + per_token x tokens` by least
squares over recent steps, each weighted by recency (a half-life in steps), since the cost moves with
contexts, adapters and the machine's neighbours. On a GPU, where a decode step is bound by reading the
weights, `per_token` is small beside `fixed` and a batch row beside interactive ones is nearly free; on a
CPU each token costs nearly in proportion. `spare(tokens, slack)` is how many more tokens keep a step of
`tokens` within `1 + slack` of its own time: what the batch class may add beside interactive work.
"""

from dataclasses import dataclass

HALF_LIFE_STEPS = 256.0  # a step's weight in the fit halves after this many later steps
MIN_STEPS = 16  # observations before the fit is trusted
MIN_SPREAD_TOKENS = 4.0  # the steps' token counts must vary this much (std) for a slope to be read


@dataclass
class StepCost:
    half_life_steps: float = HALF_LIFE_STEPS
    steps: int = 0
    # Recency-weighted sums: weights, tokens, seconds, tokens^2, tokens x seconds.
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        keep = 0.5 ** (1.0 / self.half_life_steps)
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + tokens
        self._y = self._y * keep + seconds
        self._xx = self._xx * keep + tokens * tokens
        self._xy = self._xy * keep + tokens * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the steps seen cannot tell them apart."""
        if self.steps < MIN_STEPS:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < MIN_SPREAD_TOKENS**2:
            return None
        per_token = max(0.0, (self._xy / self._w - mean_x * mean_y) / var_x)
        return max(0.0, mean_y - per_token * mean_x), per_token

    def spare(self, tokens: int, slack: float) -> int | None:
        """Tokens that can join a step of `tokens` while its time grows by at most `slack` of itself; None
        while the fit is unknown."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        if per_token <= 0.0:
            return None  # no measurable cost per token: no bound from time
        return int(slack * (fixed / per_token + tokens))
