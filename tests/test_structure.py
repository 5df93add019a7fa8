"""The package's shape (docs/architecture.md): imports run one way between layers, no module
imports itself back through others, and old import paths fail with one line naming the new one.
Read from the source with ``ast``: nothing here depends on what is installed."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tandem_lit"

# a module of a layer may import its own layer and those after it, never those before it
LAYERS = [
    {"__main__", "cli", "demo"},
    {"training"},
    {"evaluation"},
    {"rollout", "objectives", "verifiers", "data"},
    {"models"},
    {"errors", "paths", "runs", "write_faults"},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The tandem_lit modules ``path`` imports (at any depth of the file, lazy imports included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in out if m.startswith("tandem_lit")}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in files.items():
        # a name imported from a package may be a submodule or an attribute: keep what is a module
        edges[name] = {m for m in imported(path) if m in files and m != name}
    return edges


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_no_module_imports_a_higher_layer():
    wrong = [
        f"{a} -> {b}" for a, targets in graph().items() if a != "tandem_lit"
        for b in targets if b != "tandem_lit" and layer(b) < layer(a)
    ]
    assert not wrong, "imports against the layering of docs/architecture.md:\n" + "\n".join(sorted(wrong))


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    edges = graph()
    # a package's __init__ re-exporting its own children is not a cycle worth counting
    for name in edges:
        edges[name] = {b for b in edges[name] if not (name.count(".") and b.startswith(name + "."))}
    cycles = import_cycles(edges)
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_finds_a_cycle_through_several_modules():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert import_cycles(edges) == [["a", "b", "c"]]
    assert import_cycles({**edges, "c": {"d"}}) == []


def test_the_top_level_holds_only_what_every_layer_uses():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    # (__main__: python -m tandem_lit; write_faults: every layer that writes a run file goes through it)
    assert modules == ["__main__", "cli", "errors", "paths", "runs", "write_faults"]


@pytest.mark.parametrize("old, new", [
    ("tandem_lit.module", "tandem_lit.training.module"),
    ("tandem_lit.rollout.fast", "tandem_lit.rollout.static"),
    ("tandem_lit.eval_steps", "tandem_lit.evaluation.steps"),
    ("tandem_lit.tiny", "tandem_lit.models.tiny"),
    ("tandem_lit.evaluation.results", "tandem_lit.rollout.result"),
])
def test_an_old_import_path_fails_with_one_line_naming_the_new_one(old, new):
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(old)
    message = str(info.value)
    assert "\n" not in message and new in message


def test_a_moved_name_fails_with_one_line_naming_its_new_place():
    with pytest.raises(ImportError) as info:
        from tandem_lit.evaluation import RolloutResult  # noqa: F401
    assert "\n" not in str(info.value) and "tandem_lit.rollout.RolloutResult" in str(info.value)


def test_short_names_still_import_from_their_families():
    from tandem_lit.rollout import FastEngine, WordHandoff
    from tandem_lit.training import TandemModule
    from tandem_lit.verifiers import GSM8KVerifier

    assert TandemModule.__module__ == "tandem_lit.training.module"
    assert FastEngine.__module__ == "tandem_lit.rollout.static.engine"
    assert WordHandoff and GSM8KVerifier
