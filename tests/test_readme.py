"""The README's commands are the ones CI runs: a green CI must mean the README works."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [
        line for block in blocks for line in block.strip().splitlines() if line and not line.startswith("#")
    ]


def test_ci_runs_the_readme_test_command() -> None:
    test_command = next(c for c in readme_commands() if "pytest" in c)
    ci_lines = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")
    ]
    assert test_command in ci_lines
