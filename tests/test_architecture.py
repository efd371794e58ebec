"""The house's one-way boundaries, read from the source with `ast` (docs/architecture.md draws them).

- app/ (the HTTP face and the CLI) sees the engine only through `deployments.engine.interface`, and
  imports nothing else of deployments/ (the Serve wiring composes app/, never the other way).
- The engine (deployments/engine/) imports nothing of app/, billing/, ray or the Serve wiring.
- The Serve wiring (deployments/ outside engine/) reaches the engine only through its interface too.
- adapters/ imports none of app/, billing/, deployments/; billing/ none of app/ or deployments/.
- app/errors.py is the only place that chooses an HTTP status: nothing else in app/ builds an APIError.
- No two modules import each other, directly or around a loop (imports inside functions and under
  TYPE_CHECKING count: they are the same dependency, only later).

Each rule is checked on the real tree, and a self-test proves the checker fails on planted mistakes.
"""

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "deployments", "adapters", "billing", "migrations")
ENGINE = "deployments.engine"
INTERFACE = "deployments.engine.interface"


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module (or the package a name came from), dotted
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(root, path)] = path
    return found


def imports(root: Path) -> Iterator[Import]:
    """Every import statement of our packages, resolved to a module where the name is one."""
    known = modules(root)
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(name, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_package, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    yield Import(name, submodule if submodule in known else base, node.lineno)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def boundary_violations(root: Path) -> list[str]:
    problems = []
    for imp in imports(root):
        src, dst = imp.source, imp.target
        where = f"{src}:{imp.line} imports {dst}"
        if _within(src, "app") and _within(dst, "deployments") and dst != INTERFACE:
            problems.append(f"{where}: app/ sees deployments/ only through {INTERFACE}")
        if _within(src, ENGINE):
            outside = _within(dst, "deployments") and not _within(dst, ENGINE)
            if outside or any(_within(dst, p) for p in ("app", "billing", "ray")):
                problems.append(f"{where}: the engine imports nothing of app/, billing/, ray or Serve")
        wiring = _within(src, "deployments") and not _within(src, ENGINE)
        if wiring and _within(dst, ENGINE) and dst != INTERFACE:
            problems.append(f"{where}: the Serve wiring reaches the engine only through {INTERFACE}")
        if _within(src, "adapters") and any(_within(dst, p) for p in ("app", "billing", "deployments")):
            problems.append(f"{where}: adapters/ stands on its own")
        if _within(src, "billing") and any(_within(dst, p) for p in ("app", "deployments")):
            problems.append(f"{where}: billing/ imports none of app/ or deployments/")
    return list(dict.fromkeys(problems))  # one line per import statement and target


def status_choices(root: Path) -> list[str]:
    """`APIError(...)` calls (a status picked on the spot) anywhere in app/ but app/errors.py."""
    found = []
    for name, path in modules(root).items():
        if not _within(name, "app") or name == "app.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "APIError":
                found.append(f"{name}:{node.lineno} builds an APIError: name the error in app/errors.py")
    return found


def import_cycles(root: Path) -> list[list[str]]:
    """Strongly connected groups of modules (Tarjan), each a loop of imports."""
    graph: dict[str, set[str]] = {name: set() for name in modules(root)}
    for imp in imports(root):
        if imp.target in graph and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_imports_respect_the_boundaries() -> None:
    assert boundary_violations(ROOT) == []


def test_no_module_imports_itself_around_a_loop() -> None:
    assert import_cycles(ROOT) == []


def test_only_app_errors_chooses_http_statuses() -> None:
    assert status_choices(ROOT) == []


# -- the checker itself fails on planted mistakes -------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    for relative, source in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"app/routes.py": "from deployments.engine.llm_engine import LLMEngine\n"}, "app/ sees"),
        ({"app/x.py": "from deployments import builder\n", "deployments/builder.py": ""}, "app/ sees"),
        ({"app/x.py": "def f():\n    import deployments.router\n"}, "app/ sees"),
        ({"deployments/engine/step.py": "import ray\n"}, "the engine imports nothing"),
        ({"deployments/engine/step.py": "from billing.models import Tenant\n"}, "the engine imports nothing"),
        ({"deployments/engine/step.py": "from ..router import R\n", "deployments/router.py": ""}, "engine"),
        ({"deployments/ingress.py": "from deployments.engine.sampler import Sampler\n"}, "Serve wiring"),
        ({"adapters/store.py": "from billing import db\n"}, "adapters/ stands"),
        ({"billing/usage.py": "from app.settings import Settings\n"}, "billing/ imports none"),
    ],
)
def test_a_wrong_import_is_caught(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    problems = boundary_violations(_tree(tmp_path, files))
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_interface_and_allowed_imports_pass(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "app/generation.py": "from deployments.engine.interface import EngineRequest\n",
            "deployments/ingress.py": "from app import main\nfrom deployments.engine import interface\n",
            "app/main.py": "",
            "deployments/engine/interface.py": "from adapters.ref import AdapterRef\n",
            "billing/registry.py": "from adapters.ref import AdapterRef\n",
        },
    )
    assert boundary_violations(root) == []


def test_a_status_chosen_outside_app_errors_is_caught(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "app/errors.py": "class APIError(Exception): ...\nOOPS = APIError(500)\n",
            "app/routes/usage.py": (
                "from app.errors import APIError\ndef f():\n    raise APIError(400, 'no')\n"
            ),
        },
    )
    assert status_choices(root) == ["app.routes.usage:3 builds an APIError: name the error in app/errors.py"]


def test_a_cycle_is_caught_even_through_a_function_level_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "app/cli/__init__.py": "from app.cli import billing\n",
            "app/cli/billing.py": "def run():\n    from app.cli import helper\n",
            "app/cli/helper.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import app.cli\n",
            "app/ok.py": "import app.cli.helper\n",
        },
    )
    assert import_cycles(root) == [["app.cli", "app.cli.billing", "app.cli.helper"]]
