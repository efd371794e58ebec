"""The house's one-way boundaries, read from the source with `ast` (docs/architecture.md draws them).

Every top-level folder holding Python files git tracks (or would add: not ignored), a package or not, is a
unit with an allow-list of the units it may import (`ALLOWED`); `deployments.engine` is a unit of its own
inside `deployments`, and a unit may name a single module of another (the engine's interface) instead of
the whole unit. A folder (or top-level module) without an entry fails. What counts as an import:

- `import` and `from ... import` anywhere (inside functions and under TYPE_CHECKING too: the same
  dependency, only later), relative ones resolved;
- a dotted attribute that reaches a module past the one imported (`interface.llm_engine.X`,
  `deployments.engine.scheduler.Y` after `import deployments.engine.interface`);
- dynamic imports: `importlib.import_module`, `__import__`, and a string naming one of our modules
  (`"deployments.engine.async_engine"`). The importers count under any name: `import_module as load`,
  `il.import_module` after `import importlib as il`, `im = importlib.import_module`, `getattr(importlib,
  "import_module")`; a call through one is a dynamic import, and so is any other use of one (passed or
  bound to a name: what it will import is not read here). Each is an error unless `DYNAMIC` names it with
  its reason; a literal target is also held to the allow-list. tests/ may import anything, so its
  strings (monkeypatch targets, logger names) are not read as imports.

Also: the engine imports only the standard library and `ENGINE_THIRD_PARTY`; only app/errors.py touches
`HTTPException` or chooses a status (`APIError(...)`); no module imports itself around a loop, where
importing `a.b.c` also runs the `__init__` of `a` and `a.b` (unless the importer is inside them already).
Each rule is checked on the real tree, and the self-tests below plant each kind of mistake in a temporary
tree and prove the checker reports it. `python -m tests.test_architecture` prints the unit-level graph.
"""

import ast
import functools
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "deployments.engine"
INTERFACE = "deployments.engine.interface"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"

# The one arrow up (bench -> tests): bench.gpu_check runs the suite's reference-equality scenario on a GPU,
# with the suite's PEFT reference as the oracle, so a GPU engine is held to the very test the CPU one is.
TEST_SUPPORT = ("tests.engine.reference", "tests.engine.test_reference_equality")
# unit -> the units (or single modules) it may import besides itself. docs/architecture.md's table says
# the same, and test_the_documented_table_is_the_enforced_one holds them together.
ALLOWED: dict[str, frozenset[str]] = {
    "adapters": frozenset(),
    "migrations": frozenset(),
    "billing": frozenset({"adapters", "migrations"}),
    ENGINE: frozenset({"adapters"}),
    "app": frozenset({"adapters", "billing", INTERFACE}),
    "deployments": frozenset({"adapters", "billing", "app", INTERFACE}),
    "bench": frozenset({"adapters", "billing", "migrations", "app", "deployments", ENGINE, *TEST_SUPPORT}),
    "tests": frozenset({"adapters", "billing", "migrations", "app", "deployments", ENGINE, "bench"}),
}
# Lower to higher: an arrow from a unit to one listed later points up (none is allowed).
LAYERS = ("adapters", "migrations", "billing", ENGINE, "app", "deployments", "bench", "tests")

# The engine runs (and is tested) in a plain process: torch and its model libraries, nothing of a server.
ENGINE_THIRD_PARTY = frozenset(
    {"torch", "transformers", "numpy", "llguidance", "pydantic", "bitsandbytes", "safetensors", "tokenizers",
     "triton", "peft", "gptqmodel"}
)  # fmt: skip

# (importing module, what it names: a module, or "*" for a computed name) -> why it is dynamic.
DYNAMIC: dict[tuple[str, str], str] = {
    (INTERFACE, "deployments.engine.async_engine"): "lazy: importing the interface must not import torch",
    (INTERFACE, "deployments.engine.local_client"): "lazy: importing the interface must not import torch",
    (INTERFACE, "*"): "the lazy table above, read by module __getattr__",
    ("deployments.engine.model.gpu_kernels._triton", "*"): "triton where installed (CUDA, dev extras)",
    (
        "deployments.engine.model.native_kernel",
        "deployments.engine.model.native_kernel",
    ): "compiles in a child process",
    ("app.dependency_noise", "*"): "a noisy third-party import, its output discarded",
    ("bench.gpu_kernels", "bitsandbytes"): "bound as Any: bitsandbytes is untyped",
    ("bench.gpu_check", "*"): "reads installed packages' versions by name",
    ("bench.gpu_check", "bench.gpu_check"): "runs its steps as child processes",
    ("bench.gpu_check", "bench.host_overhead"): "runs it as a child process",
    ("bench.gpu_check", "bench.multi_lora"): "runs it as a child process",
    ("bench.gpu_check", "bench.gpu_kernels"): "runs it as a child process",
    ("bench.gpu_check", "bench.awq_step"): "runs it as a child process",
    ("bench.gpu_check", "bench.family_step"): "runs it as a child process",
    ("bench.load.platform", "bench.ray_ops"): "Ray operations as child processes of the load test",
}
STATUS_MODULE = "app.errors"
# The engine's model side (deployments/engine/model/) is a layer below the rest of the engine: it runs the
# step it is handed and knows the sequences, but none of what decides them (scheduler, engines, grammar).
MODEL = "deployments.engine.model"
MODEL_MAY_IMPORT = frozenset(
    f"{ENGINE}.{name}" for name in ("config", "cpu_features", "errors", "logprobs", "outputs", "sequence")
)


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module (or the package a name came from), dotted
    line: int
    how: str = "import"  # import | attribute | dynamic


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@functools.cache
def python_files(root: Path) -> tuple[Path, ...]:
    """The tree's Python files: in a git checkout each one git tracks or would add (not ignored: a virtual
    environment is not ours), whatever folder holds it; elsewhere (the self-tests' trees) each on disk."""
    if not (root / ".git").exists():
        return tuple(sorted(root.rglob("*.py")))
    command = ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"]
    listed = subprocess.run(command, check=True, capture_output=True, text=True).stdout.split("\0")
    return tuple(sorted(root / name for name in listed if name and (root / name).is_file()))


def top_packages(root: Path) -> list[str]:
    """Every top-level folder holding Python files (with an __init__.py or not: without one it still
    imports, as a namespace package), and every top-level module."""
    return sorted({module_name(root, path).split(".")[0] for path in python_files(root)})


def modules(root: Path) -> dict[str, Path]:
    return {module_name(root, path): path for path in python_files(root)}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def unit_of(module: str) -> str:
    """The allow-list unit a module belongs to: the longest ALLOWED key containing it, else its top level."""
    matches = [unit for unit in ALLOWED if _within(module, unit)]
    return max(matches, key=len) if matches else module.split(".")[0]


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


@dataclass
class Parsed:
    tree: ast.Module
    is_package: bool
    bindings: dict[str, str]  # a name this module binds -> the module it is


def _parse(known: dict[str, Path]) -> dict[str, Parsed]:
    parsed: dict[str, Parsed] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        bindings: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bindings[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        bindings[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_package, node)
                for alias in node.names:
                    if f"{base}.{alias.name}" in known:
                        bindings[alias.asname or alias.name] = f"{base}.{alias.name}"
        parsed[name] = Parsed(tree, is_package, bindings)
    return parsed


def _dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything that is not a plain dotted name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _reach(parsed: dict[str, Parsed], start: str, attrs: list[str]) -> str:
    """The deepest module `start.attrs...` names: a submodule, or a module another module bound."""
    current = start
    for attr in attrs:
        if f"{current}.{attr}" in parsed:
            current = f"{current}.{attr}"
        elif current in parsed and attr in parsed[current].bindings:
            current = parsed[current].bindings[attr]
        else:
            break
    return current


IMPORTERS = frozenset({"import_module", "__import__"})  # importlib's (any module's) and the builtin


def _is_importer(node: ast.AST, names: set[str]) -> bool:
    """`node` reads an importer: a name bound to one, `<anything>.import_module` or `.__import__`, or
    `getattr(<anything>, "import_module")`."""
    if isinstance(node, ast.Name):
        return node.id in names and isinstance(node.ctx, ast.Load)
    if isinstance(node, ast.Attribute):
        return node.attr in IMPORTERS and isinstance(node.ctx, ast.Load)
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in IMPORTERS
    )


def _importer_names(tree: ast.Module) -> set[str]:
    """The names a module binds to an importer: the importers' own, `from importlib import import_module
    as load`, and assignments of an importer (`im = importlib.import_module`, `b = a` after that)."""
    names = set(IMPORTERS)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names if alias.name in IMPORTERS)
    assignments: list[tuple[list[ast.expr], ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            assignments.append((node.targets, node.value))
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            assignments.append(([node.target], node.value))
    while True:
        bound = {
            target.id
            for targets, value in assignments
            if _is_importer(value, names)
            for target in targets
            if isinstance(target, ast.Name)
        }
        if bound <= names:
            return names
        names |= bound


def _named_module(value: str, known: dict[str, Path]) -> str | None:
    """The module a string names (`pkg.mod` or `pkg.mod:attr`), if it is one of ours."""
    candidate = value.split(":")[0]
    return candidate if re.fullmatch(r"\w+(\.\w+)+", candidate) and candidate in known else None


@functools.cache
def imports(root: Path) -> tuple[Import, ...]:
    """Every import of our packages, resolved to a module where the name is one (read once per tree)."""
    return tuple(_imports(root))


def _imports(root: Path) -> Iterator[Import]:
    known = modules(root)
    parsed = _parse(known)
    for name, info in parsed.items():
        reads_strings = unit_of(name) != "tests"
        docstrings = {id(doc) for n in ast.walk(info.tree) if (doc := _docstring(n)) is not None}
        inner = {id(n.value) for n in ast.walk(info.tree) if isinstance(n, ast.Attribute)}
        importers = _importer_names(info.tree)
        called = {
            id(n.func)
            for n in ast.walk(info.tree)
            if isinstance(n, ast.Call) and _is_importer(n.func, importers)
        }
        for node in ast.walk(info.tree):
            if isinstance(node, ast.Call) and id(node.func) in called:
                literal = node.args[0] if node.args else None
                is_str = isinstance(literal, ast.Constant) and isinstance(literal.value, str)
                target = literal.value if is_str else "*"  # type: ignore[union-attr]
                yield Import(name, target, node.lineno, "dynamic")
            elif id(node) not in called and _is_importer(node, importers):  # passed on or bound: to what?
                yield Import(name, "*", getattr(node, "lineno", 0), "dynamic")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(name, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, info.is_package, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    yield Import(name, submodule if submodule in known else base, node.lineno)
            elif (
                isinstance(node, ast.Attribute)
                and id(node) not in inner  # the whole dotted name, not each of its prefixes
                and (parts := _dotted(node))
                and parts[0] in info.bindings
            ):
                start = info.bindings[parts[0]]
                reached = _reach(parsed, start, parts[1:])
                if reached != start and not _within(start, reached):
                    yield Import(name, reached, node.lineno, "attribute")
            elif (
                reads_strings
                and isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and (named := _named_module(node.value, known))
            ):
                yield Import(name, named, node.lineno, "dynamic")


def _docstring(node: ast.AST) -> ast.expr | None:
    """The docstring's node of a module, class or function (prose naming a module is no import)."""
    if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    first = node.body[0] if node.body else None
    return first.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None


def _first_party(target: str, packages: list[str]) -> bool:
    return target.split(".")[0] in packages


def boundary_violations(root: Path) -> list[str]:
    problems = []
    packages = top_packages(root)
    for package in packages:
        if package not in ALLOWED:
            shown = f"{package}/" if (root / package).is_dir() else f"{package}.py"
            problems.append(f"{shown}: top-level Python with no entry in ALLOWED (what may it import?)")
    stdlib = sys.stdlib_module_names
    seen_dynamic: set[tuple[str, str]] = set()
    for imp in imports(root):
        src, dst = imp.source, imp.target
        where = f"{src}:{imp.line} {'imports' if imp.how == 'import' else f'{imp.how} import of'} {dst}"
        if imp.how == "dynamic":
            if (src, dst) not in DYNAMIC and unit_of(src) != "tests":
                problems.append(f"{where}: a dynamic import; import it, or name it in DYNAMIC with why")
            seen_dynamic.add((src, dst))
            if dst == "*":
                continue
        source_unit = unit_of(src)
        if _first_party(dst, packages):
            target_unit = unit_of(dst)
            allowed = ALLOWED.get(source_unit, frozenset())
            if target_unit != source_unit and not any(_within(dst, entry) for entry in allowed):
                may = sorted(allowed) or "nothing of ours"
                problems.append(f"{where}: {source_unit} may import only {may}")
        elif source_unit == ENGINE and dst.split(".")[0] not in stdlib | ENGINE_THIRD_PARTY:
            problems.append(f"{where}: the engine imports only the standard library and ENGINE_THIRD_PARTY")
    return list(dict.fromkeys(problems))  # one line per import statement and target


def model_layer_violations(root: Path) -> list[str]:
    """Imports from the engine's model side of engine modules outside it and above its basics."""
    found = []
    for imp in imports(root):
        src, dst = imp.source, imp.target
        above = _within(dst, ENGINE) and not _within(dst, MODEL) and dst not in MODEL_MAY_IMPORT
        if _within(src, MODEL) and above:
            may = sorted(MODEL_MAY_IMPORT)
            found.append(f"{src}:{imp.line} imports {dst}: the model side may import only {may}")
    return found


def stale_dynamic_entries(root: Path) -> list[tuple[str, str]]:
    """DYNAMIC entries that no longer match any dynamic import (the allow-list must not rot)."""
    found = {(imp.source, imp.target) for imp in imports(root) if imp.how == "dynamic"}
    return sorted(set(DYNAMIC) - found)


def status_choices(root: Path) -> list[str]:
    """`APIError(...)` calls (a status picked on the spot) anywhere in app/ but app/errors.py, and any
    mention of `HTTPException` outside it (FastAPI's and Starlette's: a status chosen where it is raised)."""
    found = []
    for name, path in modules(root).items():
        if name == STATUS_MODULE or unit_of(name) == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _within(name, "app") and isinstance(node, ast.Call) and _called(node) == "APIError":
                found.append(f"{name}:{node.lineno} builds an APIError: name the error in app/errors.py")
            names = [a.name.split(".")[-1] for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if "HTTPException" in names or _mentions(node, "HTTPException"):
                line = getattr(node, "lineno", 0)
                found.append(f"{name}:{line} uses HTTPException: name the error in app/errors.py")
    return list(dict.fromkeys(found))


def _called(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else ""


def _mentions(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == name) or (
        isinstance(node, ast.Attribute) and node.attr == name
    )


def dependency_graph(root: Path, packages_above: bool = True) -> dict[str, set[str]]:
    """Module -> modules its imports run: each target, and (`packages_above`) the packages above it the
    importer is not inside already, whose __init__ runs first."""
    known = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for imp in imports(root):
        if imp.target not in known or imp.target == imp.source:
            continue
        graph[imp.source].add(imp.target)
        parts = imp.target.split(".")
        for i in range(1, len(parts) if packages_above else 1):
            package = ".".join(parts[:i])
            if package in known and not _within(imp.source, package):
                graph[imp.source].add(package)
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """Strongly connected groups of modules (Tarjan), each a loop of imports."""
    graph = dependency_graph(root)
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

    # Raised for the walk only: a limit left at 10,000 let a later test in this worker render a template
    # that the default limit refuses (test_a_past_calls_arguments_nested_too_deep_are_400_not_500).
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return cycles


def unit_graph(root: Path) -> Counter[tuple[str, str]]:
    """(from unit, to unit) -> how many module-level import edges, between different units."""
    edges: Counter[tuple[str, str]] = Counter()
    for source, targets in dependency_graph(root, packages_above=False).items():
        for target in targets:
            pair = (unit_of(source), unit_of(target))
            if pair[0] != pair[1]:
                edges[pair] += 1
    return edges


def documented_table(text: str) -> dict[str, frozenset[str]]:
    """docs/architecture.md's package table: first column's unit -> the units its last column names."""
    table: dict[str, frozenset[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        first = re.match(r"`([\w/.]+)`", cells[0]) if len(cells) >= 3 else None
        if first is None:
            continue
        unit = first.group(1).rstrip("/").replace("/", ".")
        names = re.findall(r"`([\w/.]+)`", cells[-1])
        table[unit] = frozenset(n.removesuffix(".py").rstrip("/").replace("/", ".") for n in names)
    return table


# -- the real tree -------------------------------------------------------------------------------------


def test_imports_respect_the_allow_lists() -> None:
    assert boundary_violations(ROOT) == []


def test_the_model_side_imports_nothing_above_it() -> None:
    assert model_layer_violations(ROOT) == []


def test_importing_the_engine_interface_does_not_import_torch() -> None:
    """The ingress imports the interface (and so the engine's config, errors, outputs): torch stays out."""
    code = "import sys, deployments.engine.interface; assert 'torch' not in sys.modules, 'torch imported'"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_dynamic_import_allowed_by_name_still_exists() -> None:
    assert stale_dynamic_entries(ROOT) == []


def test_no_module_imports_itself_around_a_loop() -> None:
    assert import_cycles(ROOT) == []


def test_only_app_errors_chooses_http_statuses() -> None:
    assert status_choices(ROOT) == []


def test_the_one_arrow_up_is_the_benches_reuse_of_test_support() -> None:
    up = {(a, b) for a, b in unit_graph(ROOT) if LAYERS.index(a) < LAYERS.index(b)}
    assert up <= {("bench", "tests")}


def test_the_documented_table_is_the_enforced_one() -> None:
    assert documented_table(ARCHITECTURE_DOC.read_text()) == ALLOWED


# -- the checker itself fails on planted mistakes -------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for package in ("app", "deployments", "deployments/engine", "adapters", "billing", "migrations"):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    for relative, source in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(tmp_path).parents:
            if folder != Path("."):
                (tmp_path / folder / "__init__.py").touch()
        path.write_text(source)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"app/routes.py": "from deployments.engine.llm_engine import LLMEngine\n"}, "app may import only"),
        ({"app/x.py": "from deployments import builder\n", "deployments/builder.py": ""}, "app may import"),
        ({"app/x.py": "def f():\n    import deployments.router\n"}, "app may import only"),
        ({"deployments/engine/step.py": "import ray\n"}, "the engine imports only the standard library"),
        ({"deployments/engine/step.py": "from fastapi import Request\n"}, "the engine imports only the"),
        ({"deployments/engine/step.py": "import bench.measure\n", "bench/measure.py": ""}, "engine may"),
        ({"deployments/engine/step.py": "from billing.models import Tenant\n"}, "deployments.engine may"),
        ({"deployments/engine/step.py": "from ..router import R\n", "deployments/router.py": ""}, "engine"),
        ({"deployments/ingress.py": "from deployments.engine.sampler import Sampler\n"}, "deployments may"),
        ({"adapters/store.py": "from billing import db\n"}, "adapters may import only nothing of ours"),
        ({"billing/usage.py": "from app.settings import Settings\n"}, "billing may import only"),
        ({"migrations/env.py": "from billing.models import Base\n"}, "migrations may import only"),
        ({"tools/__init__.py": "", "tools/x.py": "import os\n"}, "tools/: top-level Python with no entry"),
        ({"setup.py": "import os\n"}, "setup.py: top-level Python with no entry"),
    ],
)
def test_a_wrong_import_is_caught(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    problems = boundary_violations(_tree(tmp_path, files))
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import importlib\nE = importlib.import_module('deployments.engine.llm_engine')\n", "a dynamic"),
        ("from importlib import import_module\ndef f(n):\n    return import_module(n)\n", "of *: a dynamic"),
        ("E = __import__('deployments.engine.llm_engine')\n", "a dynamic import"),
        ("ENGINE = 'deployments.engine.llm_engine:LLMEngine'\n", "a dynamic import"),
        (
            "import importlib\na = importlib.import_module\nb = a\nE = b('deployments.engine.llm_engine')\n",
            "a dy",
        ),
    ],
)
def test_a_dynamic_import_is_caught(tmp_path: Path, source: str, expected: str) -> None:
    root = _tree(tmp_path, {"app/x.py": source, "deployments/engine/llm_engine.py": ""})
    problems = boundary_violations(root)
    assert any(expected in p for p in problems), problems
    if "*" not in expected:  # a named target is also held to the allow-list
        assert any("app may import only" in p for p in problems), problems


def test_a_folder_of_python_without_init_is_a_unit_too(tmp_path: Path) -> None:
    """No __init__.py: `import scripts.seed` still works (a namespace package), so it is held all the same."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "seed.py").write_text("from deployments.engine.llm_engine import LLMEngine\n")
    problems = boundary_violations(_tree(tmp_path, {"deployments/engine/llm_engine.py": ""}))
    assert problems == [
        "scripts/: top-level Python with no entry in ALLOWED (what may it import?)",
        "scripts.seed:1 imports deployments.engine.llm_engine: scripts may import only nothing of ours",
    ]


def test_in_a_checkout_the_python_git_tracks_or_would_add_is_read(tmp_path: Path) -> None:
    """Tracked and new folders are units; ignored ones (a virtual environment, build output) are not."""
    files = {
        ".gitignore": "build/\n.venv/\n",
        "scripts/seed.py": "import os\n",  # committed
        "tools/fresh.py": "import os\n",  # not added yet
        "build/lib/x.py": "import os\n",
        ".venv/lib/site.py": "import os\n",
        "app/x.py": "def f():\n    from build.lib import x\n",  # build/ is no package of ours: third party
    }
    root = _tree(tmp_path, files)
    (root / "scripts" / "__init__.py").unlink()

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", "scripts", ".gitignore")
    assert [p.relative_to(root).as_posix() for p in python_files(root) if "__init__" not in p.name] == [
        "app/x.py", "scripts/seed.py", "tools/fresh.py"
    ]  # fmt: skip
    assert boundary_violations(root) == [
        f"{unit}/: top-level Python with no entry in ALLOWED (what may it import?)"
        for unit in ("scripts", "tools")
    ]


@pytest.mark.parametrize(
    ("source", "line"),
    [  # the importers under other names, each called with a computed name on the line given
        ("from importlib import import_module as load\ndef f(n):\n    return load(n)\n", 3),
        ("import importlib as il\ndef f(n):\n    return il.import_module(n)\n", 3),
        ("import importlib\nim = importlib.import_module\ndef f(n):\n    return im(n)\n", 4),
        ("import importlib\na = importlib.import_module\nb = a\ndef f(n):\n    return b(n)\n", 5),
        ("import importlib\ndef f(n):\n    if (im := importlib.import_module):\n        return im(n)\n", 4),
        ("imp = __import__\ndef f(n):\n    return imp(n)\n", 3),
        ("from builtins import __import__ as imp\ndef f(n):\n    return imp(n)\n", 3),
        ("import builtins\ndef f(n):\n    return builtins.__import__(n)\n", 3),
        ("import importlib\ndef f(n):\n    return getattr(importlib, 'import_module')(n)\n", 3),
        # passed on or bound: what it will import is not read here, so that is a dynamic import itself
        ("import importlib\nMODULES = list(map(importlib.import_module, NAMES))\n", 2),
        ("import importlib\nclass C:\n    load = importlib.import_module\n", 3),
        ("from importlib import import_module as load\nLOADERS = {'x': load}\n", 2),
    ],
)
def test_an_importer_under_another_name_is_caught(tmp_path: Path, source: str, line: int) -> None:
    problems = boundary_violations(_tree(tmp_path, {"app/x.py": source}))
    expected = (
        f"app.x:{line} dynamic import of *: a dynamic import; import it, or name it in DYNAMIC with why"
    )
    assert expected in problems, problems


def test_a_string_that_is_no_module_of_ours_is_no_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "billing/models.py": "FK = 'adapters.id'\nLOGGER = 'app.middleware'\n",
            "app/x.py": '"""See deployments.engine.llm_engine for why."""\n',
            "deployments/engine/llm_engine.py": "",
        },
    )
    assert boundary_violations(root) == []


@pytest.mark.parametrize(
    "source",
    [
        "from deployments.engine import interface\nX = interface.llm_engine.LLMEngine\n",
        "import deployments.engine.interface\nX = deployments.engine.llm_engine.LLMEngine\n",
        "import deployments.engine.interface as i\nX = i.llm_engine.LLMEngine\n",
    ],
)
def test_reaching_past_the_interface_through_an_attribute_is_caught(tmp_path: Path, source: str) -> None:
    root = _tree(
        tmp_path,
        {
            "app/x.py": source,
            "deployments/engine/interface.py": "from deployments.engine import llm_engine\n",
            "deployments/engine/llm_engine.py": "class LLMEngine: ...\n",
        },
    )
    problems = boundary_violations(root)
    assert problems == [f"app.x:2 attribute import of deployments.engine.llm_engine: app may import only "
                        f"{sorted(ALLOWED['app'])}"], problems  # fmt: skip


def test_the_interface_and_allowed_imports_pass(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "app/completions/generation.py": (
                "from deployments.engine.interface import EngineRequest\n"
                "import deployments.engine.interface\nR = deployments.engine.interface.EngineRequest\n"
            ),
            "deployments/ingress.py": "from app import main\nfrom deployments.engine import interface\n",
            "app/main.py": "",
            "deployments/engine/interface.py": "from adapters.ref import AdapterRef\nimport torch, json\n",
            "billing/registry.py": "from adapters.ref import AdapterRef\nimport migrations\n",
            "adapters/ref.py": "",
        },
    )
    assert boundary_violations(root) == []


def test_a_dynamic_import_named_in_the_allow_list_passes(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "deployments/engine/interface.py": (
                "import importlib\n_LAZY = {'AsyncEngine': 'deployments.engine.async_engine'}\n"
                "def load(n):\n    return importlib.import_module(_LAZY[n])\n"
            ),
            "deployments/engine/async_engine.py": "",
        },
    )
    assert boundary_violations(root) == []


@pytest.mark.parametrize(
    ("target", "caught"),
    [("scheduler", True), ("llm_engine", True), ("grammar.compiler", True), ("sequence", False)],
)
def test_a_model_side_import_from_above_is_caught(tmp_path: Path, target: str, caught: bool) -> None:
    path = "deployments/engine/" + target.replace(".", "/") + ".py"
    root = _tree(
        tmp_path, {"deployments/engine/model/runner.py": f"import deployments.engine.{target}\n", path: ""}
    )
    problems = model_layer_violations(root)
    assert len(problems) == caught and all("the model side may import only" in p for p in problems), problems


def test_a_status_chosen_outside_app_errors_is_caught(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "app/errors.py": (
                "from starlette.exceptions import HTTPException\nclass APIError(Exception): ...\n"
                "OOPS = APIError(500)\n"
            ),
            "app/routes/usage.py": "from app.errors import APIError\ndef f():\n    raise APIError(400, '')\n",
            "app/routes/models.py": "from fastapi import HTTPException\n",
            "deployments/ingress.py": "import fastapi\ndef f():\n    raise fastapi.HTTPException(404)\n",
        },
    )
    assert status_choices(root) == [
        "app.routes.models:1 uses HTTPException: name the error in app/errors.py",
        "app.routes.usage:3 builds an APIError: name the error in app/errors.py",
        "deployments.ingress:3 uses HTTPException: name the error in app/errors.py",
    ]


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


def test_a_cycle_closed_through_a_package_init_is_caught(tmp_path: Path) -> None:
    """metrics imports limits.state (which imports nothing), but that runs limits/__init__ first, which
    imports protocol, which imports metrics: a loop no import statement shows whole."""
    root = _tree(
        tmp_path,
        {
            "app/limits/__init__.py": "from app.limits.protocol import Limits\n",
            "app/limits/protocol.py": "from app.metrics import Counter\nclass Limits: ...\n",
            "app/limits/state.py": "x = 1\n",
            "app/metrics.py": "def f():\n    from app.limits.state import x\nclass Counter: ...\n",
        },
    )
    assert import_cycles(root) == [["app.limits", "app.limits.protocol", "app.metrics"]]


def test_a_package_importing_its_own_submodules_is_no_cycle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "app/limits/__init__.py": "from app.limits.state import S\n",
            "app/limits/state.py": "from app.limits.protocol import P\n",
            "app/limits/protocol.py": "",
        },
    )
    assert import_cycles(root) == []


def test_an_arrow_up_shows_in_the_unit_graph(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"billing/x.py": "from app import y\n", "app/y.py": ""})
    assert unit_graph(root) == Counter({("billing", "app"): 1})


def test_the_table_reader_reads_what_the_doc_writes() -> None:
    text = (
        "| package | what | may import |\n| --- | --- | --- |\n"
        "| `app/` | faces | `adapters/`, `billing/`, `deployments/engine/interface.py` only |\n"
        "| `adapters/` | specs | nothing of ours |\n"
    )
    assert documented_table(text) == {
        "app": frozenset({"adapters", "billing", INTERFACE}),
        "adapters": frozenset(),
    }


if __name__ == "__main__":
    # The unit-level import graph (module edges between units), for docs and closing notes.
    for (a, b), n in sorted(unit_graph(ROOT).items(), key=lambda e: (LAYERS.index(e[0][0]), e[0][1])):
        direction = "UP" if LAYERS.index(a) < LAYERS.index(b) else ""
        print(f"{a:20} -> {b:20} {n:4} {direction}")
