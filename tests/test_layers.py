"""The package layering of docs/ARCHITECTURE.md, checked on the source: imports only go downward.

Every import counts, including the lazy ones inside functions (a lazy upward import is still a
dependency of the lower layer on the higher one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# rank: a package may import packages of a strictly lower rank (and itself).
LAYERS = {
    "schemas": 0,
    "bus": 0,  # the wire protocol; bus-connection helpers
    "dataset": 1,
    "models": 1,  # data + partitions; networks + checkpoint format
    "flow": 1,
    "client": 1,  # flow-matching path + solvers; the client side of a job
    "training": 2,
    "workers": 2,  # trainers; expert workers
    "coordinator": 3,  # the serving path
    "web": 4,
    "evaluation": 4,
    "benchmarks": 4,  # clients of a fleet
    "fuzzing": 5,  # drives workers, coordinator and web as targets
    "infra": 6,  # the CLI and process launch
}

# The coordinator's pure core and the solver it steps with: no I/O, no bus, no subject names
# (schedule/update are tested with hand-made replies).
PURE_MODULES = [
    "coordinator/scheduler.py",
    "coordinator/scheduler_config.py",
    "coordinator/job_table.py",
    "coordinator/admission.py",
    "coordinator/cohorts.py",
    "coordinator/restore.py",
    "coordinator/batch.py",
    "coordinator/rows.py",
    "coordinator/strategies.py",
    "coordinator/dispatch.py",
    "coordinator/retry_policy.py",
    "coordinator/hedging.py",
    "coordinator/reply_check.py",
    "coordinator/done_parts.py",
    "flow/solver.py",
    "flow/path.py",
]
IMPURE = {"nats", "aiohttp", "asyncio", "socket", "subprocess", "schemas.subjects", "bus"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """(dotted module, line) for every absolute import in `path`, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno))
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def test_every_top_level_package_has_a_layer():
    found = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "checkpoints", "docs"}
    assert found == set(LAYERS), (
        f"packages without a layer (add them here and to docs/ARCHITECTURE.md): {found ^ set(LAYERS)}"
    )


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_only_go_downward(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module, line in _imports(path):
            top = module.split(".")[0]
            if top in LAYERS and top != package and LAYERS[top] >= LAYERS[package]:
                bad.append(
                    f"{path.relative_to(ROOT)}:{line} imports {module} (layer {LAYERS[top]} >= {LAYERS[package]})"
                )
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_scheduler_core_does_no_io(module):
    bad = [
        f"{module}:{line} imports {name}"
        for name, line in _imports(ROOT / module)
        if any(name == i or name.startswith(i + ".") for i in IMPURE)
    ]
    assert not bad, "\n".join(bad)
    assert "ddm.v1" not in (ROOT / module).read_text(), f"{module} spells a NATS subject"


def test_the_web_viewer_is_a_client_not_a_coordinator():
    """web/ reaches a fleet through client/ (schemas only), so the viewer's install needs no coordinator (nor torch)."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "web").rglob("*.py"))
        for module, line in _imports(path)
        if module.split(".")[0] in ("coordinator", "models", "workers")
    ]
    assert not bad, "\n".join(bad)


def test_schemas_is_the_protocol_only():
    """schemas/ holds messages, codec, subjects, limits, errors, version: no generators, no I/O helpers."""
    files = {p.name for p in (ROOT / "schemas").glob("*.py")}
    assert files <= {
        "__init__.py",
        "errors.py",
        "limits.py",
        "messages.py",
        "subjects.py",
        "tensor.py",
        "version.py",
        "wire.py",
        "spec.py",
    }, files


def test_architecture_doc_lists_every_module():
    """docs/ARCHITECTURE.md has one line per module (CLI subcommand modules infra/cmd_*.py are covered by
    infra/cli.py's line)."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    modules = sorted(
        str(p.relative_to(ROOT))
        for pkg in LAYERS
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and not p.name.startswith("cmd_")
    )
    missing = [m for m in modules if f"`{m}`" not in doc]
    assert not missing, f"modules missing from docs/ARCHITECTURE.md: {missing}"
    import re

    listed = set(re.findall(r"`([a-z_]+/[a-z_/]+\.py)`", doc))
    gone = sorted(m for m in listed if not (ROOT / m).exists())
    assert not gone, f"docs/ARCHITECTURE.md lists modules that do not exist: {gone}"


def _module_name(path: Path) -> str:
    """The dotted module of a source file; a package's `__init__.py` is the package itself."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported project module: "file:line" of the first such import}, every import counted
    (lazy and TYPE_CHECKING ones too, relative ones resolved). `from pkg import name` is an import of
    module `pkg.name` when that is a module, else of `pkg`; `import a.b` is an import of `a.b` alone."""
    files = {_module_name(p): p for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")}

    def known(dotted: str) -> str | None:  # the deepest project module that `dotted` names or lies in
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, dict[str, str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the file's package, one level up per extra dot
                    up = package.split(".")[: package.count(".") + 2 - node.level]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base) for a in node.names]
            else:
                continue
            for target in targets:
                if target is not None and target != name:
                    edges.setdefault(target, f"{path.relative_to(ROOT)}:{node.lineno}")
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Cycles [a, b, ..., a] of `graph`: in each group of modules that reach one another, a shortest
    one through each module that the cycles before it left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan, iterative (no recursion limit on long chains)
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        w = stack.pop()
                        group.add(w)
                        if w == node:
                            break
                    groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in (g for g in groups if len(g) > 1):
        covered: set[str] = set()
        for start in sorted(group):  # a shortest cycle through each module no cycle so far went through
            if start not in covered:
                cycles.append(_shortest_cycle(graph, group, start))
                covered.update(cycles[-1])
    return sorted(cycles)


def _shortest_cycle(graph: dict[str, dict[str, str]], group: set[str], start: str) -> list[str]:
    """A shortest cycle [start, ..., start] within `group` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while True:
        nxt = []
        for f in frontier:
            if start in graph[f]:
                return paths[f] + [start]
            for w in sorted(graph[f]):
                if w in group and w not in paths:
                    paths[w] = paths[f] + [w]
                    nxt.append(w)
        frontier = nxt


def test_the_cycle_finder_reports_each_cycle():
    graph = {"a": {"b": ""}, "b": {"a": "", "c": ""}, "c": {"b": ""}, "d": {"a": ""}}
    assert _cycles(graph) == [["a", "b", "a"], ["c", "b", "c"]]
    assert _cycles({"a": {"b": ""}, "b": {}}) == []


def test_no_import_cycles():
    """No module imports itself through others, lazily or not: shared types live below both users."""
    graph = _import_graph()
    found = [
        " -> ".join(c) + "\n    (" + ", ".join(graph[a][b] for a, b in zip(c, c[1:])) + ")" for c in _cycles(graph)
    ]
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(found)


def test_readme_layer_table_matches_the_layers_checked_here():
    """README.md's package table names each package's layer as LAYERS does (a newcomer reads the README first)."""
    import re

    table = dict(re.findall(r"^\| `([a-z_]+)/` \| (\d+) \|", (ROOT / "README.md").read_text(), flags=re.M))
    assert {k: int(v) for k, v in table.items()} == LAYERS


def test_the_cli_solver_choices_are_the_solvers_flow_has():
    """bus.options spells the solver names out (it sits below flow/); they must stay flow.solver's."""
    from bus.options import SOLVERS
    from flow.solver import METHODS

    assert SOLVERS == METHODS


#: The serving path, whose units a newcomer reads first: no class over MAX_CLASS_LINES, no function over
#: MAX_FUNCTION_LINES (docstrings included), so each reads in one sitting.
SERVING_PATH = ("coordinator", "workers", "client", "web")
MAX_CLASS_LINES = 450
MAX_FUNCTION_LINES = 80


def test_units_on_the_serving_path_stay_small():
    too_long = []
    for package in SERVING_PATH:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    limit = MAX_CLASS_LINES
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    limit = MAX_FUNCTION_LINES
                else:
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines > {limit}")
    assert not too_long, "\n".join(too_long)
