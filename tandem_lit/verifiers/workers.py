"""A small pool of worker processes that run one function with a hard wall-clock limit per call.

Why not threads or ``signal.alarm``: a grader can spend minutes inside sympy on a pathological
expression; ``SIGALRM`` only works in the main thread and cannot interrupt C code, and a
thread cannot be killed. A process can. A call that overruns costs its result
(``status="timeout"``); the worker is killed and a fresh one takes its place, so the next call
is unaffected.

The workers are plain child processes (this file run by path, serving ``module:factory`` or
``/path/file.py:factory``) talking length-prefixed pickles over stdin/stdout, not ``multiprocessing``: nothing
depends on the parent's ``__main__`` being importable or on the fork start method (unsafe
after CUDA or with threads running), and the pool works from any thread. The child calls
``factory()`` once at start-up (imports, warm-up, self-test) and serves the function it returns;
if that fails, the parent raises with the child's traceback instead of grading anything.
"""

from __future__ import annotations

import importlib
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem_lit.errors import TandemLitError  # (imports nothing: the child may import it too)

_HEADER = struct.Struct(">I")  # frame = 4-byte big-endian length + pickle
_BOOT = (
    "import sys; from importlib.util import module_from_spec, spec_from_file_location; "
    "spec = spec_from_file_location('_tandem_lit_worker', sys.argv[1]); module = module_from_spec(spec); "
    "sys.modules[spec.name] = module; spec.loader.exec_module(module); "
    "sys.exit(module._serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))"
)


@dataclass(frozen=True)
class TaskResult:
    """The outcome of one call: ``value`` is set only when ``status == "ok"``."""

    status: str  # "ok" | "timeout" (overran, worker killed) | "crashed" (worker died) | "error" (raised)
    value: Any = None
    error: str | None = None


class WorkerStartError(RuntimeError):
    """A worker could not start (its factory failed, it died, or it did not answer in time)."""


class WorkersLostError(TandemLitError, RuntimeError):
    """Every one of the last ``crash_limit`` calls lost its worker: something outside kills them
    (the kernel's out-of-memory killer, most often). One crash costs its call; a pool whose
    workers all die would otherwise turn every later result into a counted failure."""


def _frame(obj: Any) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class _Worker:
    """One child process and its read buffer; ``task`` is the index it is busy with."""

    def __init__(self, argv: list[str], env: dict[str, str], start_timeout_s: float):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.buffer = bytearray()
        self.ready = False
        self.task: int | None = None
        self.deadline = time.monotonic() + start_timeout_s

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, obj: Any) -> bool:
        try:
            self.proc.stdin.write(_frame(obj))
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def receive(self) -> list[Any] | None:
        """Frames that have fully arrived (after select said readable); None at end of file."""
        data = os.read(self.fileno(), 1 << 16)
        if not data:
            return None
        self.buffer += data
        frames = []
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            if len(self.buffer) < _HEADER.size + size:
                break
            frames.append(pickle.loads(bytes(self.buffer[_HEADER.size : _HEADER.size + size])))
            del self.buffer[: _HEADER.size + size]
        return frames

    def kill(self) -> None:
        _kill(self.proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a zombie we cannot reap; nothing else to do
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:  # pragma: no cover
            pass


def _shutdown(workers: list[_Worker], owner_pid: int) -> None:
    """Stop every worker (finalizer / atexit). A forked copy of the parent leaves them alone."""
    if os.getpid() != owner_pid:
        return
    for worker in workers:
        _kill(worker.proc)
    workers.clear()


class WorkerPool:
    """Up to ``size`` worker processes running ``factory()``'s function, each call limited to ``timeout_s``.

    Workers start lazily (all ``size`` on the first ``run``) and stop on
    ``close()``, when the pool is garbage-collected, or at interpreter exit. ``run`` is
    thread-safe; concurrent callers take turns.

    Args:
        factory: ``"module:function"`` or ``"/path/file.py:function"`` (loaded without its package); the
            child calls it once to get the worker function.
        size: Most worker processes alive at once.
        timeout_s: Wall-clock limit of one call, in seconds.
        start_timeout_s: Limit on a worker's start-up (imports, warm-up).
        memory_limit_mb: Address-space limit of each worker (``RLIMIT_AS``), None for none.
        crash_limit: Calls in a row whose worker died before ``WorkersLostError`` ends the run.
    """

    def __init__(
        self,
        factory: str,
        size: int,
        timeout_s: float,
        start_timeout_s: float = 120.0,
        memory_limit_mb: int | None = None,
        crash_limit: int = 16,
    ):
        if size < 1:
            raise ValueError(f"a worker pool needs size >= 1, got {size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.factory = factory
        self.size = size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.timeouts = 0  # calls killed for overrunning, over the pool's life
        self.crashes = 0  # calls whose worker died
        self.crash_limit = crash_limit
        self._crashes_in_a_row = 0
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._owner_pid)

    # -- public -------------------------------------------------------------------------------

    def run(self, tasks: Sequence[tuple[Any, ...]], budget_s: float | None = None) -> list[TaskResult]:
        """Call the worker function on each argument tuple, in parallel; results in task order.

        ``budget_s`` bounds the whole batch: calls still running when it runs out are killed and
        calls not yet started are not run (both ``timeout``), so n hostile tasks cost at most the
        budget, not n x timeout_s / size."""
        with self._lock:
            self._forget_if_forked()
            return self._run(list(tasks), math.inf if budget_s is None else time.monotonic() + budget_s)

    def close(self) -> None:
        with self._lock:
            if os.getpid() == self._owner_pid:
                for worker in self._workers:
                    try:
                        worker.proc.stdin.close()  # the child exits at end of input
                    except OSError:
                        pass
                for worker in self._workers:
                    try:
                        worker.proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        pass
                    _kill(worker.proc)
            self._workers.clear()

    @property
    def alive(self) -> int:
        return sum(1 for w in self._workers if w.proc.poll() is None)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # -- internals ----------------------------------------------------------------------------

    def _forget_if_forked(self) -> None:
        # A forked child must not talk to (or kill) its parent's workers: start its own.
        if os.getpid() != self._owner_pid:
            self._workers.clear()
            self._owner_pid = os.getpid()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._owner_pid)

    def _spawn(self) -> _Worker:
        # Run this file by path, not `-m tandem_lit...`: importing the package would import torch.
        cpu_backstop = int(2 * self.timeout_s) + 10  # only ever reached by an orphan (see _limit_cpu)
        argv = [sys.executable, "-c", _BOOT, __file__, self.factory, str(self.memory_limit_mb or 0), str(cpu_backstop)]
        env = dict(os.environ)
        # The child must import this package even when the parent found it through sys.path edits.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        worker = _Worker(argv, env, self.start_timeout_s)
        self._workers.append(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def _start_failed(self, message: str) -> WorkerStartError:
        for worker in list(self._workers):
            self._retire(worker)
        return WorkerStartError(message)

    def _run(self, tasks: list[tuple[Any, ...]], batch_deadline: float) -> list[TaskResult]:
        results: list[TaskResult | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        while pending or any(w.task is not None for w in self._workers):
            if pending and time.monotonic() >= batch_deadline:
                for index in pending:
                    results[index] = TaskResult("timeout", error="not run: the batch's time budget ran out")
                self.timeouts += len(pending)
                pending.clear()
                continue
            for worker in [w for w in self._workers if w.ready and w.task is None and w.proc.poll() is not None]:
                self._retire(worker)  # died while idle (killed from outside): replace it quietly
            for _ in range(self.size - len(self._workers)):  # keep the pool full: a spare absorbs a kill
                self._spawn()
            for worker in [w for w in self._workers if w.ready and w.task is None]:
                if not pending:
                    break
                index = pending.popleft()
                if worker.send((index, tasks[index])):
                    worker.task, worker.deadline = index, min(time.monotonic() + self.timeout_s, batch_deadline)
                else:  # the task never reached it: give it to another worker
                    pending.appendleft(index)
                    self._retire(worker)
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            if not waiting:
                continue
            wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            readable, _, _ = select.select(waiting, [], [], wait_s)
            for worker in readable:
                frames = worker.receive()
                for frame in frames or ():
                    self._handle(worker, frame, results)
                if frames is None:
                    self._lost(worker, results)
            now = time.monotonic()
            for worker in [w for w in self._workers if w.deadline <= now and (w.task is not None or not w.ready)]:
                if not worker.ready:
                    raise self._start_failed(
                        f"a worker ({self.factory}) did not start within {self.start_timeout_s:.0f} s"
                    )
                results[worker.task] = TaskResult("timeout", error=f"exceeded {self.timeout_s} s (or the batch's budget); worker killed")
                self.timeouts += 1
                self._retire(worker)
                self._spawn()  # warm the replacement now, so the next call does not wait for its start-up
        return results  # type: ignore[return-value]

    def _handle(self, worker: _Worker, frame: Any, results: list[TaskResult | None]) -> None:
        kind = frame[0]
        if kind == "ready":
            worker.ready = True
        elif kind == "failed":
            raise self._start_failed(f"a worker ({self.factory}) failed to start:\n{frame[1]}")
        else:
            index, ok, payload = frame
            results[index] = TaskResult("ok", value=payload) if ok else TaskResult("error", error=payload)
            worker.task = None
            self._crashes_in_a_row = 0

    def _lost(self, worker: _Worker, results: list[TaskResult | None]) -> None:
        """The worker died (end of file or broken pipe)."""
        try:
            code = worker.proc.wait(timeout=1)  # (its pipe closes a moment before it is reaped)
        except subprocess.TimeoutExpired:
            code = None
        if not worker.ready:
            self._retire(worker)
            raise self._start_failed(f"a worker ({self.factory}) exited with code {code} before it was ready")
        if worker.task is not None:
            results[worker.task] = TaskResult("crashed", error=f"worker exited with code {code}")
            self.crashes += 1
            self._crashes_in_a_row += 1
        self._retire(worker)
        if self._crashes_in_a_row >= self.crash_limit:
            for other in list(self._workers):
                self._retire(other)
            how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise WorkersLostError(
                f"the worker processes of {self.factory.rsplit('/', 1)[-1]} keep dying: the last {self._crashes_in_a_row} "
                f"calls each lost theirs (the last {how}; SIGKILL is most often the kernel's out-of-memory killer). Free "
                "memory on the host or run fewer workers, then resume with --ckpt_path <run folder>/checkpoints/last.ckpt"
            )
        self._spawn()


# -- the child side ---------------------------------------------------------------------------


def _load(spec: str) -> Any:
    """``module:attribute`` or ``/path/to/file.py:attribute`` (loaded alone, without its package)."""
    location, _, attribute = spec.rpartition(":")
    if location.endswith(".py"):
        from importlib.util import module_from_spec, spec_from_file_location

        name = f"_tandem_lit_{Path(location).stem}"
        module_spec = spec_from_file_location(name, location)
        module = module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(location)
    return getattr(module, attribute)


def _limit_cpu(seconds: int) -> None:
    """Let the kernel end this process if the next call uses ``seconds`` more CPU time.

    The parent kills an overrunning call long before (``timeout_s`` of wall-clock time); this
    is for a worker orphaned by a parent that died hard while a call was stuck in C code (a
    huge integer power holds the GIL, so no thread of ours could react).
    """
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + seconds
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _serve(factory_spec: str, memory_limit_mb: int, cpu_limit_s: int) -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which stops us
    # Keep private copies of the pipes and point fds 0/1 elsewhere, so a stray print() in a
    # library cannot corrupt the protocol.
    inbox = os.fdopen(os.dup(0), "rb", buffering=0)
    outbox = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)

    def send(obj: Any) -> None:
        outbox.write(_frame(obj))

    def read_exact(count: int) -> bytes | None:
        chunks = bytearray()
        while len(chunks) < count:
            data = inbox.read(count - len(chunks))
            if not data:
                return None
            chunks += data
        return bytes(chunks)

    try:
        function = _load(factory_spec)()
        if memory_limit_mb > 0:
            import resource

            limit = memory_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        send(("failed", traceback.format_exc()))
        return 1
    send(("ready", None))
    while True:
        header = read_exact(_HEADER.size)
        if header is None:
            return 0
        payload = read_exact(_HEADER.unpack(header)[0])
        if payload is None:
            return 0
        index, args = pickle.loads(payload)
        _limit_cpu(cpu_limit_s)
        try:
            send((index, True, function(*args)))
        except Exception:  # noqa: BLE001
            send((index, False, traceback.format_exc(limit=5)))
