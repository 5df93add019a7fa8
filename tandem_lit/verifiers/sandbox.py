"""Run one untrusted Python program against test inputs, under kernel-enforced isolation.

A run is three processes (docs/security.md has the whole story and the threat table):

1. The **trainer** (this module, ``Sandbox.run``) writes the job (program + test inputs, never
   the expected outputs) to a fresh temporary folder, starts the launcher in a new session with
   an empty environment, reads one result line per test case with a size cap, and kills the
   whole thing when its wall-clock budget runs out.
2. The **launcher** and 3. the **driver** (pid 1 of the sandbox) are ``sandbox_child.py``, run
   as ``python -I -S -c <its text>``: that module is the only code that runs inside the
   sandbox, it imports only the standard library, and nothing here runs there. Its docstring
   says what each of the two does.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tandem_lit.verifiers import sandbox_child
from tandem_lit.verifiers.sandbox_child import CHILD_ENV, DRIVER_MARK, PROTECTIONS

__all__ = [
    "CaseResult", "DRIVER_MARK", "Limits", "PROTECTIONS", "RunResult", "Sandbox", "SandboxUnavailableError",
    "refusal_message",
]

log = logging.getLogger(__name__)


class SandboxUnavailableError(RuntimeError):
    """A protection the sandbox needs cannot be applied on this machine (fail closed)."""

    def __init__(self, protection: str, reason: str):
        self.protection, self.reason = protection, reason
        super().__init__(refusal_message(protection, reason))


def refusal_message(protection: str, reason: str) -> str:
    if protection == "network":
        fix = (f"set allow_missing: [{protection}] to run programs without it (DANGEROUS: "
               f"{_DANGER[protection]}; see docs/security.md)")
    else:
        fix = f"this protection cannot be opted out of; {_FIX[protection]}"
    return f"the code sandbox refuses to run programs: protection {protection!r} is missing: {reason}. Fix: {fix}"


_DANGER = {"network": "programs can open network connections, to the internet and to services on this machine"}
_FIX = {
    "privilege_drop": "set unprivileged_uid to a uid that exists and is not root",
    "namespaces": "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
    "kernel.apparmor_restrict_unprivileged_userns=0) or run as root",
    "filesystem": "the mount namespace must allow tmpfs and bind mounts (run outside restrictive seccomp/AppArmor profiles)",
    "rlimits": "the hard resource limits of this process must allow the configured values",
}


@dataclass(frozen=True)
class Limits:
    """Per-run limits (docs/security.md lists the mechanism behind each)."""

    timeout_s: float = 4.0  # wall clock of one test case (the child is SIGKILLed); also its CPU limit
    completion_timeout_s: float = 30.0  # wall clock of all cases of one program (the sandbox is killed)
    memory_mb: int = 1024  # RLIMIT_AS of each process
    max_processes: int = 16  # RLIMIT_NPROC inside the sandbox's user namespace; threads count
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_file_mb: int = 16  # RLIMIT_FSIZE and the size of the program's /tmp (a tmpfs)
    max_output_bytes: int = 1 << 20  # stdout (or return value) of one case; more fails the case

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= self.completion_timeout_s:
            raise ValueError(f"need 0 < timeout_s <= completion_timeout_s, got {self.timeout_s}, {self.completion_timeout_s}")
        for name in ("memory_mb", "max_processes", "max_open_files", "max_file_mb", "max_output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_open_files < 16:
            raise ValueError(f"max_open_files must be >= 16 (the driver needs a few), got {self.max_open_files}")
        if self.max_processes < 4:
            raise ValueError(f"max_processes must be >= 4 (launcher, driver, case), got {self.max_processes}")


@dataclass(frozen=True)
class CaseResult:
    """One test case as the sandbox saw it; the caller compares ``stdout``/``value`` with the expectation."""

    status: str  # "ok" | "error" (exception / nonzero exit) | "timeout" | "signal" | "output_limit" | "not_run"
    stdout: str = ""
    value: str | None = None  # JSON of the return value (call) or "true" (functional check passed)
    stderr: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class RunResult:
    status: str  # "ok" | "compile_error" | "timeout" (whole run) | "output_limit" | "stopped" | "crashed"
    cases: list[CaseResult] = field(default_factory=list)
    detail: str = ""

    @property
    def timed_out(self) -> bool:
        return self.status == "timeout" or any(c.status == "timeout" for c in self.cases)


class Sandbox:
    """Runs programs under the protections in docs/security.md; thread-safe (one process per run).

    Args:
        limits: Time, memory, process, file and output limits.
        allow_missing: Protections the sandbox may run without when the machine cannot apply them
            (only ``"network"``); each one missing is logged as a warning. The others
            (``namespaces``, ``filesystem``, ``privilege_drop``, ``rlimits``) cannot be opted out of.
        unprivileged_uid: uid (and gid) programs run as when the trainer is root.
    """

    _simulate_missing: tuple[str, ...] = ()  # tests patch this: the launcher then acts as if these failed

    def __init__(self, limits: Limits | None = None, allow_missing: tuple[str, ...] = (), unprivileged_uid: int = 65534):
        unknown = set(allow_missing) - {"network"}
        if unknown:
            raise ValueError(
                f"allow_missing may name 'network' only; {sorted(unknown)} cannot be "
                f"opted out of (known protections: {list(PROTECTIONS)})"
            )
        self.limits = limits or Limits()
        self.allow_missing = tuple(allow_missing)
        self.unprivileged_uid = unprivileged_uid
        self._checked = False
        self._lock = threading.Lock()
        self.python, self.prefix = _interpreter()

    # Pickled with a verifier: no lock, and the next process checks the machine again.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_checked")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._checked = False

    def check(self) -> list[str]:
        """Run a tiny program once; raise SandboxUnavailableError if a required protection is missing.
        Returns the protections that were skipped (allowed to be missing)."""
        result, report = self._run({"kind": "stdio", "program": "print(input()[::-1])", "cases": [{"stdin": "ko\n"}]})
        if result.status != "ok" or not result.cases or result.cases[0].stdout != "ok\n":
            raise RuntimeError(f"the sandbox's self-test failed: {result}")
        skipped = report.get("skipped", [])
        for protection in skipped:
            log.warning(
                "CODE SANDBOX RUNS WITHOUT PROTECTION %r (allowed by allow_missing): %s", protection,
                _DANGER.get(protection, "see docs/security.md"),
            )
        with self._lock:
            self._checked = True
        return skipped

    def run(self, job: dict, on_case: Callable[[int, CaseResult], bool] | None = None) -> RunResult:
        """Run ``job`` = {"kind": "stdio"|"call"|"functional", "program": source, "cases": [...],
        "entry": "fn" | "Class().method" (call, functional), "check": source (functional),
        "prelude": source run before the program (call, functional), "stop_on_failure": bool}.
        Cases are {"stdin": text} (stdio) or {"args": [...], "kwargs": {...}} (call).
        ``on_case(i, result)`` sees each case as it finishes; returning False stops the run."""
        if not self._checked:
            self.check()
        return self._run(job, on_case)[0]

    # -- internals ------------------------------------------------------------------------------

    def _config(self, top: str) -> dict:
        return {
            "uid": self.unprivileged_uid,
            "root": os.path.join(top, "root"),
            "job": os.path.join(top, "job.json"),
            "python": self.python,
            "prefix": self.prefix,
            "source": _child_source(),
            "allow_missing": list(self.allow_missing),
            "simulate_missing": list(self._simulate_missing),
            "trainer_pid": os.getpid(),
            "limits": asdict(self.limits),
        }

    def _run(self, job: dict, on_case=None) -> tuple[RunResult, dict]:
        limits = self.limits
        payload = {
            "prelude": None, "check": None, "entry": None, "stop_on_failure": False, **job,
            "timeout_s": limits.timeout_s, "max_output_bytes": limits.max_output_bytes,
        }
        top = tempfile.mkdtemp(prefix="tandem-sandbox-")
        proc = None
        report: dict = {}
        result = RunResult("crashed")
        try:
            os.mkdir(os.path.join(top, "root"))
            with open(os.path.join(top, "job.json"), "w", encoding="utf-8") as handle:
                json.dump(payload, handle, ensure_ascii=False)
            cfg = self._config(top)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _child_source(), "--launch", json.dumps(cfg)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=top, env=dict(CHILD_ENV), start_new_session=True, close_fds=True,
            )
            result, report = _collect(proc, len(job["cases"]), limits, on_case)
            if "refused" in report:
                raise SandboxUnavailableError(report["refused"], report["reason"])
            if "error" in report:
                raise RuntimeError(f"the sandbox launcher failed: {report['error']}")
            return result, report
        finally:
            if proc is not None:
                _stop(proc, report.get("pidfd"), finished=result.status in ("ok", "compile_error"))
            _remove_tree(top)


def _interpreter() -> tuple[str, str]:
    """The real interpreter binary and its installation prefix (a venv's python is a symlink)."""
    python = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if os.path.realpath(sys.base_exec_prefix) != prefix or not python.startswith(prefix + os.sep):
        raise SandboxUnavailableError(
            "filesystem", f"the interpreter {python} is not inside its installation prefix {prefix}, so the "
            f"sandbox cannot mount it; use a standard CPython installation",
        )
    return python, prefix


_SOURCE_CACHE: list[str] = []


def _child_source() -> str:
    """The text of ``sandbox_child.py``: the code the sandboxed interpreters run (stdlib only),
    passed with ``-c`` because the checkout is not inside the sandbox's root."""
    if not _SOURCE_CACHE:
        _SOURCE_CACHE.append(Path(sandbox_child.__file__).read_text(encoding="utf-8"))
    return _SOURCE_CACHE[0]


def _collect(proc: subprocess.Popen, count: int, limits: Limits, on_case) -> tuple[RunResult, dict]:
    """Read the driver's result lines (stdout) and the launcher's reports (stderr) until the run
    ends, its time is up, its output is too large, or ``on_case`` says stop."""
    deadline = time.monotonic() + limits.completion_timeout_s + 1.0  # start-up is not the program's time
    line_cap = 8 * limits.max_output_bytes + (1 << 16)  # a case line: JSON-escaped stdout, stderr tail
    cases: list[CaseResult] = []
    report: dict = {}
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    status, detail = "crashed", ""
    finished = False
    while buffers and not finished:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status, detail = "timeout", f"the program ran past completion_timeout_s={limits.completion_timeout_s}"
            break
        readable, _, _ = select.select(list(buffers), [], [], remaining)
        for fd in readable:
            data = os.read(fd, 1 << 16)
            if not data:
                del buffers[fd]
                continue
            buffer = buffers[fd]
            buffer += data
            while b"\n" in buffer:
                line, _, rest = bytes(buffer).partition(b"\n")
                buffer[:] = rest
                message = _parse(line)
                if fd == proc.stderr.fileno():
                    report.update(message if isinstance(message, dict) else {"stderr": line[:2000].decode("utf-8", "replace")})
                    if "pid" in report and "pidfd" not in report:
                        report["pidfd"] = _pidfd(report["pid"])
                    continue
                if not isinstance(message, dict):
                    status, detail = "crashed", f"unreadable result line: {line[:200]!r}"
                    finished = True
                    break
                if "driver_error" in message:
                    raise RuntimeError(f"the sandbox driver failed (a verifier bug):\n{message['driver_error']}")
                if "compile_error" in message:
                    status, detail = "compile_error", message["compile_error"]
                elif "done" in message:
                    status = "ok"
                    finished = True
                    break
                elif "case" in message:
                    case = CaseResult(
                        status=str(message.get("status")), stdout=str(message.get("stdout") or ""),
                        value=message.get("value"), stderr=str(message.get("stderr") or ""),
                        seconds=float(message.get("seconds") or 0.0),
                    )
                    cases.append(case)
                    if on_case is not None and on_case(len(cases) - 1, case) is False:
                        status, finished = "stopped", True
                        break
            if finished:
                break
            if len(buffer) > (line_cap if fd == proc.stdout.fileno() else 1 << 16):
                status, detail = "output_limit", "a result line exceeded the output cap"
                finished = True
                break
    if status == "crashed" and not detail:
        detail = "the sandbox ended before reporting all cases"
    cases += [CaseResult("not_run")] * (count - len(cases))
    return RunResult(status, cases, detail), report


def _parse(line: bytes):
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def _pidfd(pid: Any) -> int | None:
    try:
        return os.pidfd_open(int(pid))
    except (OSError, ValueError, TypeError):
        return None


def _stop(proc: subprocess.Popen, pidfd: int | None, finished: bool) -> None:
    """End a run and reap everything. The driver goes first (its death ends its pid namespace),
    so that the launcher reaps it; then the launcher's session."""
    if not finished and pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher is reaped only below, so its pgid is still ours
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if pidfd is not None:
        select.select([pidfd], [], [], 10.0)  # readable once the driver (and so its namespace) is gone
        os.close(pidfd)
    for stream in (proc.stdout, proc.stderr):
        stream.close()


def _remove_tree(path: str) -> None:
    def retry(function, target, _exc):
        try:
            os.chmod(os.path.dirname(target), stat.S_IRWXU)
            os.chmod(target, stat.S_IRWXU)
        except OSError:
            pass
        function(target)

    if os.path.exists(path):
        shutil.rmtree(path, onerror=retry)
