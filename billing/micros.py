"""Money as integer micro-units (millionths of the currency's unit): how the limiter backends hold it.

Six decimals is the precision of every amount in the database, so the conversion is exact both ways for
any stored amount; an amount with more decimals is refused rather than rounded (rounding happens once, at
the ledger: billing.pricing.money).
"""

from decimal import Decimal

MICROS = 1_000_000
MAX_MICROS = 10**15  # a billion units: far above any credit, far below where Lua's doubles lose integers


def to_micros(amount: Decimal) -> int:
    """`amount` (at most 6 decimals) as micro-units; ValueError for more decimals or past MAX_MICROS."""
    scaled = amount * MICROS
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{amount} has more than 6 decimals")
    micros = int(scaled)
    if abs(micros) > MAX_MICROS:
        raise ValueError(f"{amount} is out of range")
    return micros


def from_micros(micros: int) -> Decimal:
    return (Decimal(micros) / MICROS).quantize(Decimal("0.000001"))
