"""GuideLLM and AIPerf, each with its stock OpenAI backend, complete a run against the HTTP app with zero
request errors: bench.external_clients' tiny mode, as a user runs it, one tool at a time (offline: the
tokenizer is the model directory's).

Its own test rather than a row of tests/test_benches.py: on a fresh machine the tools' virtualenvs are made
first (pip, pinned versions; var/bench/tools/ keeps them for later runs), which takes longer than the
other benches' limit. No timing is asserted, only that every request of every client succeeded.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ["guidellm", "aiperf"]


def installed(tool: str) -> bool:
    return (ROOT / "var" / "bench" / "tools" / tool / ".installed").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tool", TOOLS)
def test_a_load_tool_completes_a_run_without_errors(tool: str) -> None:
    if not installed(tool) and os.environ.get("LORAPLEX_EXTERNAL_CLIENTS") != "1":
        pytest.skip(
            f"{tool}'s virtualenv is not made yet (minutes of pip on a fresh clone, past the suite's time "
            "budget): run `python -m bench.external_clients --tiny` once, or set LORAPLEX_EXTERNAL_CLIENTS=1"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "bench.external_clients", "--tiny", "--tools", tool],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700,
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(data["clients"]) == {"ours", tool}, data
    assert {"cpu", "isa", "threads"} <= set(data["machine"])
    for name, figures in data["clients"].items():
        assert figures["errors"] == 0, (name, figures)
        assert figures["requests_ok"] == data["load"]["requests"] * data["load"]["repeats"], (name, figures)
        assert figures["output_tokens_per_s"] and figures["output_tokens_per_s"] > 0, (name, figures)
    assert set(data["throughput_vs_ours"]) == {tool}
