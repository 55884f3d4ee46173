"""The package's shape (issue 43): no import cycle among cupyops/ modules,
counting imports inside functions too, and every op module short enough to
read in a sitting."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cupyops"
MAX_OP_MODULE_LINES = 600


def module_names() -> dict:
    """{dotted module name: path} of every module under cupyops/ (a
    package by its __init__.py)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, modules: dict) -> set:
    """The cupyops modules `name` (at `path`) imports anywhere in its body:
    `import cupyops.x`, `from . import x`, `from .x import y`, `from cupyops.x
    import y`; a name imported from a package is its submodule where one
    exists, else the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return {target for target in found if target in modules and target != name}


def import_graph() -> dict:
    modules = module_names()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict):
    """A list of modules forming a cycle (the first repeated at the end), or None."""
    state = {}   # name -> "open" while on the path, "done" once explored

    def visit(name, path):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [name])
            if cycle:
                return cycle
    return None


def test_graph_sees_every_form_of_import():
    graph = import_graph()
    assert "cupyops.ops.norm" in graph["cupyops"]                       # from .ops.norm import ...
    assert "cupyops.ops.softmax_split" in graph["cupyops.ops.softmax"]   # from . import softmax_split
    assert "cupyops.arrays" in graph["cupyops.ops.softmax"]              # from .. import arrays
    assert "cupyops.torch_replay" in graph["cupyops.torch"]              # from cupyops import torch_replay


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_op_modules_are_short():
    lengths = {path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "ops").glob("*.py")}
    assert {name: lines for name, lines in lengths.items() if lines > MAX_OP_MODULE_LINES} == {}
