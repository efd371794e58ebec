"""The load test's report: percentiles, the per-tenant table, and every request as JSON lines."""

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.load.tenants import TenantSetup

if TYPE_CHECKING:
    from bench.locustfile import Result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 1)


def summary_table(results: list["Result"], tenants: list[TenantSetup], groups: dict[str, list["Result"]],
                  usage: dict[str, Any], leases: dict[str, Any]) -> str:  # fmt: skip
    excused = {id(r) for r in groups["fault"]}
    header = f"{'tenant':<12} {'tier':<12} {'users':>5} {'reqs':>6} {'200':>6} {'429':>5} {'503':>5} "
    header += f"{'strm_err':>8} {'excused':>7} {'other':>5} {'rows':>6} {'leases':>6}  usage"
    lines = [header, "-" * len(header)]
    for t in tenants:
        mine = [r for r in results if r.tenant == t.name]
        status = Counter(r.status for r in mine)
        outcomes = Counter(r.outcome for r in mine)
        fault = sum(1 for r in mine if id(r) in excused)
        other = len(mine) - outcomes["ok"] - outcomes["rate_limited"] - fault
        u = usage["tenants"].get(t.name, {})
        lease = leases.get("tenants", {}).get(t.name, {}).get("leases", 0)
        lines.append(
            f"{t.name:<12} {t.tier:<12} {t.users:>5} {len(mine):>6} {status[200]:>6} {status[429]:>5} "
            f"{status[503]:>5} {outcomes['stream_error']:>8} {fault:>7} {other:>5} {u.get('rows', 0):>6} "
            f"{lease:>6}  {'ok' if u.get('ok') else 'MISMATCH'}"
        )
    return "\n".join(lines)


def dump_results(path: Path, results: list["Result"], t0: float) -> None:
    """Every request, one JSON object a line (times relative to the load's start), for a post-mortem."""
    with path.open("w") as out:
        for r in results:
            row = {**vars(r), "started": round(r.started - t0, 3), "ended": round(r.ended - t0, 3)}
            out.write(json.dumps(row) + "\n")
