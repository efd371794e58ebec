"""StepCost: what a step's work costs in time on this replica, learnt from its own steps, so the batch class
takes what interactive work can spare here rather than a count tuned on one machine.

A step's time (from its plan to its outputs) is fitted as `fixed + per_token x tokens + per_row x rows` by
least squares over recent steps, each weighted by recency (a half-life in steps), since the cost moves with
contexts, adapters and the machine's neighbours. `rows` are the sequences the step samples a token for: each
also costs its logits over the vocabulary, its sampling and its output, so on a CPU a decode row costs as
much as ten prompt tokens of a chunk, and a fit by tokens alone let the batch class's decode rows stretch
interactive steps by 60% where it meant 10%. While the steps seen cannot tell rows from tokens (only
decodes: every row one token) the fit is by tokens alone, which then carry the rows' cost. On a GPU, where a
decode step is bound by reading the weights, both are small beside `fixed`, and a batch row beside
interactive ones is nearly free. `StepFit.allowance(tokens, rows, slack)` is the time the batch class may
add to a step of that interactive work: `slack` of the step's own time.
"""

from dataclasses import dataclass

HALF_LIFE_STEPS = 256.0  # a step's weight in the fit halves after this many later steps
MIN_STEPS = 16  # observations before the fit is trusted
MIN_SPREAD_TOKENS = 4.0  # the steps' token counts must vary this much (std) for a slope to be read
COLLINEAR = 0.98  # tokens and rows correlated this much (r^2): their costs cannot be told apart


@dataclass(frozen=True)
class StepFit:
    """A step's time as fitted: seconds."""

    fixed: float  # whatever the step holds
    per_token: float  # each token computed (a prompt chunk's, a decode's)
    per_row: float = 0.0  # each sampled row, beyond its token

    def added(self, tokens: int, rows: int) -> float:
        """What `tokens` more, `rows` of them sampled, add to a step."""
        return self.per_token * tokens + self.per_row * rows

    def time(self, tokens: int, rows: int) -> float:
        return self.fixed + self.added(tokens, rows)

    def allowance(self, tokens: int, rows: int, slack: float) -> float | None:
        """Seconds that may join a step of `tokens` (`rows` of them sampled) while its time grows by at
        most `slack` of itself; None when work costs nothing measurable (no bound from time)."""
        if self.per_token <= 0.0 and self.per_row <= 0.0:
            return None
        return slack * self.time(tokens, rows)


@dataclass
class StepCost:
    half_life_steps: float = HALF_LIFE_STEPS
    rows_apart: bool = True  # False: fit by tokens alone (bench.batch's peer for the fit before rows)
    steps: int = 0
    # Recency-weighted sums: weights; tokens (t), rows (r), seconds (y); their squares and products.
    _w: float = 0.0
    _t: float = 0.0
    _r: float = 0.0
    _y: float = 0.0
    _tt: float = 0.0
    _rr: float = 0.0
    _tr: float = 0.0
    _ty: float = 0.0
    _ry: float = 0.0

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        keep = 0.5 ** (1.0 / self.half_life_steps)
        self._w = self._w * keep + 1.0
        self._t = self._t * keep + tokens
        self._r = self._r * keep + rows
        self._y = self._y * keep + seconds
        self._tt = self._tt * keep + tokens * tokens
        self._rr = self._rr * keep + rows * rows
        self._tr = self._tr * keep + tokens * rows
        self._ty = self._ty * keep + tokens * seconds
        self._ry = self._ry * keep + rows * seconds
        self.steps += 1

    def fit(self) -> StepFit | None:
        """The step's cost, or None while the steps seen cannot tell its fixed part from its tokens'."""
        if self.steps < MIN_STEPS:
            return None
        w = self._w
        mt, mr, my = self._t / w, self._r / w, self._y / w
        var_t, var_r = self._tt / w - mt * mt, self._rr / w - mr * mr
        if var_t < MIN_SPREAD_TOKENS**2:
            return None
        cov_tr, cov_ty, cov_ry = self._tr / w - mt * mr, self._ty / w - mt * my, self._ry / w - mr * my
        det = var_t * var_r - cov_tr * cov_tr
        if self.rows_apart and var_r > 0.0 and det > (1.0 - COLLINEAR) * var_t * var_r:
            per_token = (var_r * cov_ty - cov_tr * cov_ry) / det
            per_row = (var_t * cov_ry - cov_tr * cov_ty) / det
            if per_token >= 0.0 and per_row >= 0.0:
                return StepFit(max(0.0, my - per_token * mt - per_row * mr), per_token, per_row)
        per_token = max(0.0, cov_ty / var_t)  # by tokens alone: they carry whatever rows cost
        return StepFit(max(0.0, my - per_token * mt), per_token)
