"""A run that cannot write (the disk is full, the folder read only, a quota used up) ends with one
line: what could not be written and why, which checkpoint is intact, and how to resume.

The fault arrives in many wrappings: an ``OSError`` from our own writes, torch's ``RuntimeError``
over one (its zip writer), SQLAlchemy's and MLflow's exceptions over SQLite's "database or disk
is full". ``run_write_error`` finds it in any of them (the ``__cause__``/``__context__`` chain).
The writes themselves are atomic (``write_atomically``) or undone (``appending``), so what a run
saved before the fault is still whole when the line is printed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem_lit.errors import RunWriteError

# the faults of a file system a user can fix, as the line names them, and the fix
FAULTS = {
    errno.ENOSPC: ("no space left on the device", "free space on it"),
    errno.EDQUOT: ("the disk quota is used up", "free space or raise the quota"),
    errno.EROFS: ("the file system is read only", "make the run folder writable"),
    errno.EACCES: ("permission denied", "make the run folder writable"),
    errno.EPERM: ("permission denied", "make the run folder writable"),
    errno.EIO: ("an I/O error of the disk", "check the disk"),
    # (a checkpoint is pickled in host memory before it reaches the disk; AtomicCheckpointIO only)
    MemoryError: ("out of host memory", "free memory on the host (fewer processes or workers beside the run)"),
}

# SQLite's own words for the same faults (MLflow's store), which carry no errno
SQLITE_FAULTS = {
    "database or disk is full": errno.ENOSPC,
    "attempt to write a readonly database": errno.EROFS,
    "disk i/o error": errno.EIO,
    "unable to open database file": errno.EACCES,
}

LAST = Path("checkpoints") / "last.ckpt"


def chain(err: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def write_fault(err: BaseException) -> tuple[int, str | None, bool] | None:
    """(errno, the path named if any, whether MLflow's store refused) of the first file-system fault
    behind ``err``, or None when there is none."""
    store = False
    for link in chain(err):
        store = store or type(link).__module__.split(".")[0] in ("sqlalchemy", "sqlite3", "mlflow")
        if isinstance(link, OSError) and link.errno in FAULTS:
            return link.errno, link.filename, store
        text = str(link).lower()
        for words, code in SQLITE_FAULTS.items():
            if words in text:
                return code, None, True
    return None


def describe_checkpoint(last: Path) -> tuple[str, bool]:
    """What a resume would start from: ``last`` with its update count, or that none was saved."""
    try:
        import torch

        if last.is_dir():  # a sharded checkpoint: its metadata holds the counts
            meta = torch.load(last / "meta.pt", map_location="cpu", weights_only=False)
        else:
            meta = torch.load(last, map_location="cpu", mmap=True, weights_only=False)
        return f"{last} (update {meta['global_step']}) is intact", True
    except Exception:  # absent, or not a checkpoint: nothing to resume from
        return "no checkpoint was saved yet", False


def fault_line(code: int | type, what: str, run_folder: str | Path | None, checkpoint: Path | None = None) -> RunWriteError:
    """The one line for a write of ``what`` that failed with ``code``."""
    reason, fix = FAULTS[code]
    if checkpoint is None and run_folder is not None:
        checkpoint = Path(run_folder) / LAST
    if checkpoint is None:
        return RunWriteError(f"cannot write {what}: {reason}; {fix}")
    intact, resumable = describe_checkpoint(checkpoint)
    if not resumable:
        return RunWriteError(f"cannot write {what}: {reason}; {intact}: {fix}, then start the run again")
    return RunWriteError(f"cannot write {what}: {reason}. {intact} (nothing saved before was lost): {fix}, then resume "
                         f"with --ckpt_path {checkpoint}")


def run_write_error(err: BaseException, run_folder: str | Path | None = None) -> RunWriteError | None:
    """The one-line error for a file-system fault behind ``err`` (None when it is something else)."""
    found = write_fault(err)
    if found is None:
        return None
    code, path, store = found
    run_folder = run_folder or os.environ.get("TANDEM_LIT_RUN_FOLDER")
    if store and path is None:
        database = Path(run_folder) / "mlflow.db" if run_folder else None
        code = diagnose(Path(run_folder), code) if run_folder else code
        what = f"the MLflow store {database}" if database is not None and database.exists() else "the MLflow store"
    else:
        what = path or "a file of the run"
    return fault_line(code, str(what), run_folder)


def diagnose(folder: Path, code: int) -> int:
    """The file system's own state behind SQLite's vaguer words ("unable to open database file" is
    what a read-only folder gives, as it cannot create the journal)."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return code
    if stats.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if stats.f_bavail == 0:
        return errno.ENOSPC
    return code


def write_atomically(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole or not at all: a full disk leaves the earlier file."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as err:
        raise_with_path(err, path)
    finally:
        partial.unlink(missing_ok=True)


@contextmanager
def appending(path: str | Path) -> Iterator:
    """``path`` opened to append; a write that fails part-way is cut off again, so the file never
    ends in half a line."""
    path = Path(path)
    size = path.stat().st_size if path.exists() else 0
    try:
        with path.open("a", encoding="utf-8") as f:
            yield f
    except OSError as err:
        try:
            os.truncate(path, size)
        except OSError:
            pass  # (the truncation frees space; a read-only file system has nothing half-written)
        raise_with_path(err, path)


def raise_with_path(err: OSError, path: Path) -> None:
    """Re-raise ``err`` naming ``path`` (a partial file's name would mislead)."""
    if err.errno in FAULTS:
        raise OSError(err.errno, os.strerror(err.errno), str(path)) from err
    raise err
