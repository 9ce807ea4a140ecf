"""The package layout, read from the source with `ast`: every grpolab import (function-local ones
included) makes an edge of the module graph and of the graph of grpolab's top-level packages and
modules. Neither graph has a cycle, data flows one way (algo <- forward/rollout/rewards <- trainers
<- app <- cli), no module imports another's private name, and files and functions stay short."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "grpolab"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
TRAINERS = {"grpo", "sft", "evaluation"}
"""The packages that train or evaluate a policy; below them the library, above them app/ and cli/."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _module_of(name: str) -> str:
    """The module that a dotted import names (the longest prefix that is one)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path):
    """(imported module, imported name or None) for every grpolab import of the file, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "grpolab":
                    yield _module_of(alias.name), None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "grpolab":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full, None) if full in MODULES else (_module_of(base), alias.name)


def _graphs():
    modules, packages = defaultdict(set), defaultdict(set)
    private = []
    for module, path in MODULES.items():
        for target, name in _imports(module, path):
            if target != module:
                modules[module].add(target)
                if name is not None and name.startswith("_"):
                    private.append(f"{module} imports {target}.{name}")
            a, b = _top(module), _top(target)
            if a != b:
                packages[a].add(b)
    return modules, packages, private


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


MODULE_GRAPH, PACKAGE_GRAPH, PRIVATE = _graphs()


def test_no_import_cycle_between_modules():
    assert _cycles(MODULE_GRAPH) == []


def test_no_import_cycle_between_top_level_packages():
    assert _cycles(PACKAGE_GRAPH) == []


def test_data_flows_one_way():
    """algo imports nothing of grpolab; the library below the trainers imports no trainer, app, api or cli;
    the trainers import neither app, api nor cli; app imports neither api nor cli; api (the Python API,
    which cli calls) does not import cli."""
    assert PACKAGE_GRAPH.get("algo", set()) == set()
    upper = TRAINERS | {"app", "api", "cli"}
    for package, deps in PACKAGE_GRAPH.items():
        if package not in upper and package != "__main__":
            assert not deps & upper, (package, sorted(deps & upper))
    for package in TRAINERS:
        assert not PACKAGE_GRAPH.get(package, set()) & {"app", "api", "cli"}, package
    assert not PACKAGE_GRAPH.get("app", set()) & {"api", "cli"}
    assert "cli" not in PACKAGE_GRAPH.get("api", set())


def test_no_module_imports_a_private_name_of_another():
    assert PRIVATE == []


def test_files_and_functions_are_short():
    long_files, long_functions = [], []
    for module, path in MODULES.items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(module)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name}")
    assert long_files == [] and long_functions == []


def test_every_command_module_adds_its_parser():
    """cli/ parses arguments: one module per command, each with its add_parser."""
    from grpolab import cli

    for command in cli.COMMANDS:
        assert callable(command.add_parser) and callable(command.run), command.__name__
    assert {m.split(".")[-1] for m in MODULES if m.startswith("grpolab.cli.")} == \
        {c.__name__.split(".")[-1] for c in cli.COMMANDS} | {"common", "__main__"}
