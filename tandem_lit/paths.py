"""Local path or hub name: one rule for models and datasets.

``org/name`` is a hub name; a path that starts with ``.``, ``/`` or ``~``, has more than one
``/``, or whose first component is an existing local folder (``data/gsm8k-sampl`` next to a
``data/`` folder) is local. A local-looking path that does not exist is a typo: fail at once with
the closest existing names, instead of asking the hub for it (tens of seconds, then a traceback).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path


def looks_local(path: str) -> bool:
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or (os.sep == "\\" and "\\" in path):
        return True
    first = path.split("/", 1)[0]
    return "/" in path and Path(first).is_dir()


def missing_path_message(path: str, what: str) -> str:
    """``what`` (model path, dataset path) ``path`` does not exist, with near matches if any."""
    target = Path(os.path.expanduser(path))
    parent = target.parent if str(target.parent) else Path(".")
    hint = ""
    if parent.is_dir():
        close = difflib.get_close_matches(target.name, [p.name for p in parent.iterdir()], n=2, cutoff=0.6)
        if close:
            hint = " Did you mean " + " or ".join(repr(str(parent / c)) for c in close) + "?"
    return f"{what} {path!r} does not exist.{hint} Give an existing local folder or file, or a hub name like 'org/name'."
