"""The package's shape: every import points down the layers, the math imports only torch, no cycles, short
functions. docs/architecture.md draws the same layers."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "collab_convert"

# Lower numbers sit lower. A module may import its own subpackage and anything strictly lower.
LAYERS = {
    "errors": 0, "version": 0, "progress": 0, "cpu": 0, "devices": 0, "interrupts": 0,
    "io": 1, "decompose": 1, "threads": 1,
    "format": 2, "options": 2, "results": 2,
    "modeling": 3,
    "architectures": 4,
    "integration": 5, "report": 5,
    "stages": 6, "resume": 6,
    "streaming": 7,
    "predict": 7,
    "forms": 8,
    "analysis": 9, "compression": 9, "exporting": 9, "gguf_exporting": 8,
    "cli": 10, "__init__": 10, "__main__": 11,
}


def modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(collab_convert modules, external top-level packages) that `path` imports anywhere, lazily or not."""
    package_parts = name.split(".")[:-1]  # the package a relative import starts from (also for __init__)
    ours, external = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (ours if alias.name.startswith("collab_convert") else external).add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                ours.add(target)
            elif node.module.startswith("collab_convert"):
                ours.add(node.module)
            else:
                external.add(node.module)
    return ours, {e.split(".")[0] for e in external}


def unit(module: str) -> str:
    """The layer unit of a module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_layer():
    assert {unit(m) for m in modules()} <= set(LAYERS)


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_point_down(module):
    ours, _ = imports_of(module, modules()[module])
    for target in ours:
        same_unit = unit(target) == unit(module) and unit(module) != "__init__"
        assert same_unit or LAYERS[unit(target)] < LAYERS[unit(module)], f"{module} imports {target} (upward)"


@pytest.mark.parametrize("module", [m for m in sorted(modules()) if unit(m) == "decompose"])
def test_the_math_imports_only_torch(module):
    _, external = imports_of(module, modules()[module])
    assert external - set(sys.stdlib_module_names) - {"__future__"} <= {"torch", "tensorly"}


@pytest.mark.parametrize("module", [m for m in sorted(modules()) if unit(m) == "io"])
def test_file_io_knows_no_math_and_no_families(module):
    ours, _ = imports_of(module, modules()[module])
    assert not {unit(t) for t in ours} & {"decompose", "architectures", "modeling", "format"}


def test_no_import_cycles():
    graph = {}
    table = modules()
    for name, path in table.items():
        ours, _ = imports_of(name, path)
        # "from .x import y" may name a module x.y or a name y in x: keep whichever is a module
        graph[name] = {t for t in ours if t in table and t != name}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for child in graph[node]:
            if state.get(child) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, child]))
            if child not in state:
                visit(child, trail + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_no_function_is_longer_than_sixty_lines():
    long = [
        f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long


def test_no_module_is_longer_than_350_lines():
    long = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert not {name: lines for name, lines in long.items() if lines > 350}


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_module_imports_another_modules_private_names(module):
    private = []
    for node in ast.walk(ast.parse(modules()[module].read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("collab_convert")):
            private += [alias.name for alias in node.names if alias.name.startswith("_") and alias.name != "__version__"]
    assert not private, f"{module} imports {private}"


def test_every_module_is_named_in_the_architecture_doc():
    """docs/architecture.md tells where things live: a module it does not name is one a newcomer cannot find."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    unnamed = []
    for name, path in modules().items():
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and path.parent != PACKAGE:
            relative = path.parent.relative_to(PACKAGE).as_posix() + "/"  # a subpackage: its folder
        if relative not in doc:
            unnamed.append(relative)
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"
