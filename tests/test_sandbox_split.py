"""The sandbox's two sides stay two programs: the child runner (``sandbox_child.py``, the only code
that runs inside the sandbox, started as ``python -I -S -c <its text>``) imports nothing but the
standard library, so no code of the trainer's side (``sandbox.py``) or of the package can end up
in the sandbox, and it runs on its own. These run on any machine (no namespaces needed)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tandem_lit.verifiers import sandbox, sandbox_child

CHILD = Path(sandbox_child.__file__)


def child_imports() -> list[tuple[str, int]]:
    """(module, relative level) of every import statement anywhere in the child's module."""
    found = []
    for node in ast.walk(ast.parse(CHILD.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
    return found


def test_the_child_imports_only_the_standard_library():
    imports = child_imports()
    assert imports, "the parser found no imports at all"
    for module, level in imports:
        assert level == 0, f"relative import of {module!r} in the child"
        top = module.split(".")[0]
        assert top != "tandem_lit", f"the child imports {module} (the sandbox must not load the package)"
        assert top in sys.stdlib_module_names or top == "__future__", f"the child imports {module}, not stdlib"


def test_the_child_does_not_read_its_own_file():
    """Under ``-c`` there is no ``__file__``, and inside the sandbox's root there is no checkout."""
    tree = ast.parse(CHILD.read_text(encoding="utf-8"))
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert "__file__" not in names


def test_the_child_source_is_the_whole_child_module_and_runs_alone():
    """What the trainer passes with ``-c`` is exactly the child's module, and that text starts in an
    isolated interpreter without site-packages (it answers a wrong command with its usage line)."""
    source = sandbox._child_source()
    assert source == CHILD.read_text(encoding="utf-8")
    assert "class Sandbox" not in source and "def _collect" not in source
    done = subprocess.run([sys.executable, "-I", "-S", "-c", source, "--nonsense"], capture_output=True, text=True,
                          timeout=30, env=dict(sandbox_child.CHILD_ENV), cwd="/")
    assert done.returncode == 1
    assert done.stderr.strip() == "usage: --nonsense is not a sandbox command"


def test_the_parent_reexports_the_childs_constants():
    assert sandbox.DRIVER_MARK is sandbox_child.DRIVER_MARK
    assert sandbox.PROTECTIONS is sandbox_child.PROTECTIONS
