"""The code sandbox against hostile programs (docs/security.md has the table these tests fill).

Every hostile program must end with reward 0, this (the trainer's) process alive, no process of
the sandbox left, no file written or removed outside the sandbox, and its temporary folder gone.
The programs print ``PWNED`` (the expected answer) only if their attack worked.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tandem_lit.verifiers import sandbox as sandbox_module
from tandem_lit.verifiers import sandbox_child
from tandem_lit.verifiers.code import CodeVerifier, SandboxRefusedError
from tandem_lit.verifiers.sandbox import DRIVER_MARK, Limits, Sandbox, SandboxUnavailableError

pytestmark = pytest.mark.usefixtures("machine_can_sandbox")  # (tests/conftest.py)

SANDBOX_UID = 65534
LIMITS = dict(timeout_s=1.0, completion_timeout_s=4.0, memory_mb=256, max_processes=8, max_file_mb=4,
              max_output_bytes=1 << 16)


def sandbox_processes() -> set[int]:
    """Processes that belong to a sandbox: the driver mark in argv (the driver and every process a
    program forks inherit it), or, when we are root, the sandbox uid."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if DRIVER_MARK.encode() in cmdline or (os.geteuid() == 0 and uid == SANDBOX_UID):
            found.add(int(entry))
    return found


@pytest.fixture(scope="module")
def verifier():
    with CodeVerifier(reward="all", **LIMITS) as verifier:
        yield verifier


@pytest.fixture
def clean(tmp_path, monkeypatch):
    """Sandbox folders go to a folder of the test's; afterwards: nothing left there, no sandbox
    process alive, and this process alive."""
    folders = tmp_path / "sandboxes"
    folders.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folders))
    before = sandbox_processes()
    yield tmp_path
    deadline = time.monotonic() + 5
    while sandbox_processes() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sandbox_processes() - before, "a sandbox process outlived its run"
    assert list(folders.iterdir()) == [], "a sandbox folder was not removed"
    os.kill(os.getpid(), 0)


def stdio(expected: str = "PWNED\n") -> dict:
    return {"kind": "stdio", "cases": [{"input": "", "output": expected}]}


def grade(verifier: CodeVerifier, program: str, tests: dict | None = None):
    return verifier.run_tests(program, tests or stdio())


def test_a_correct_program_passes_under_the_same_limits(verifier, clean):
    passed, result = grade(verifier, "print('PWNED')")
    assert passed == [True] and result.status == "ok"


def test_infinite_loop_is_killed(verifier, clean):
    start = time.monotonic()
    passed, result = grade(verifier, "while True:\n    pass\nprint('PWNED')")
    assert passed == [False] and result.cases[0].status == "timeout"
    assert time.monotonic() - start < LIMITS["timeout_s"] + 2


def test_sleeping_past_the_limit_is_killed(verifier, clean):
    start = time.monotonic()
    passed, result = grade(verifier, "import time\ntime.sleep(60)\nprint('PWNED')")
    assert passed == [False] and result.cases[0].status == "timeout" and result.timed_out
    assert time.monotonic() - start < LIMITS["timeout_s"] + 2


def test_fork_bomb_is_contained(verifier, clean):
    program = textwrap.dedent("""
        import os, time
        children = 0
        for _ in range(10000):
            try:
                if os.fork() == 0:
                    os.setsid()  # try to leave the process group too
                    time.sleep(100)
                children += 1
            except OSError:
                break
        print("PWNED" if children > 100 else f"only {children}")
    """)
    passed, result = grade(verifier, program)
    assert passed == [False]
    assert "only" in result.cases[0].stdout or result.cases[0].status != "ok"


def test_memory_bomb_fails(verifier, clean):
    program = "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))\nprint('PWNED')"
    passed, result = grade(verifier, program)
    assert passed == [False] and result.cases[0].status == "error"
    assert "MemoryError" in result.cases[0].stderr


def test_huge_output_is_capped(verifier, clean):
    passed, result = grade(verifier, "import sys\nwhile True:\n    sys.stdout.write('PWNED\\n' * 10000)")
    assert passed == [False]
    assert result.cases[0].status in ("output_limit", "error")
    assert len(result.cases[0].stdout) <= LIMITS["max_output_bytes"]


def test_writing_outside_the_sandbox_fails(verifier, clean):
    home = clean / "home"
    home.mkdir()
    targets = [home / "pwned", Path("/tmp") / f"tandem-pwned-{os.getpid()}", Path.home() / "tandem-pwned",
               Path(__file__).parent / "tandem-pwned"]
    program = textwrap.dedent(f"""
        import os
        wrote = 0
        for path in {[str(t) for t in targets]!r} + [os.path.expanduser("~/.bashrc")]:
            try:
                with open(path, "w") as handle:
                    handle.write("x")
                wrote += 1
            except OSError:
                pass
        print("PWNED" if wrote == 5 else wrote)
    """)
    passed, _ = grade(verifier, program)
    assert passed == [False]
    for target in targets:
        assert not target.exists(), target


def test_deleting_files_fails(verifier, clean):
    home = clean / "home"
    home.mkdir()
    sentinel = home / "sentinel.txt"
    sentinel.write_text("keep me")
    program = textwrap.dedent(f"""
        import os, shutil
        removed = 0
        for action in (lambda: os.remove({str(sentinel)!r}), lambda: shutil.rmtree({str(home)!r}),
                       lambda: os.remove("/etc/hostname"), lambda: os.remove({sandbox_module.__file__!r}),
                       lambda: os.remove({sandbox_child.__file__!r})):
            try:
                action()
                removed += 1
            except OSError:
                pass
        print("PWNED" if removed else "kept")
    """)
    passed, _ = grade(verifier, program)
    assert passed == [False]
    assert sentinel.read_text() == "keep me"
    assert Path(sandbox_module.__file__).exists() and Path(sandbox_child.__file__).exists()


def test_the_trainers_environment_does_not_leak(verifier, clean, monkeypatch):
    secret = f"s3cret-{os.getpid()}"
    monkeypatch.setenv("TANDEM_TEST_SECRET", secret)
    program = textwrap.dedent(f"""
        import os
        found = os.environ.get("TANDEM_TEST_SECRET", "")
        for pid in (os.getppid(), {os.getpid()}):
            try:
                found = found or open(f"/proc/{{pid}}/environ").read()
            except OSError:
                pass
        print(found)
    """)
    passed, result = grade(verifier, program, stdio(secret + "\n"))
    assert passed == [False]
    assert secret not in result.cases[0].stdout


def test_no_network_connection_is_made(verifier, clean):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    port = listener.getsockname()[1]
    program = textwrap.dedent(f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=0.5).sendall(b"hello")
            print("PWNED")
        except OSError as err:
            print("blocked", err)
    """)
    try:
        passed, result = grade(verifier, program)
        assert passed == [False]
        assert result.cases[0].stdout.startswith("blocked")
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


@pytest.mark.parametrize(
    "attack",
    [
        "os.kill(os.getppid(), signal.SIGKILL)",
        "os.kill({trainer}, signal.SIGKILL)",
        "os.killpg(0, signal.SIGKILL)",
        "os.kill(-1, signal.SIGKILL)",
        "os.kill(1, signal.SIGTERM)",
    ],
)
def test_killing_the_parent_or_the_trainer_fails(verifier, clean, attack):
    program = f"import os, signal, time\n{attack.format(trainer=os.getpid())}\ntime.sleep(0.2)\nprint('still here')"
    passed, _ = grade(verifier, program)
    assert passed == [False]
    os.kill(os.getpid(), 0)
    assert grade(verifier, "print('PWNED')")[0] == [True]  # the verifier still works


@pytest.mark.parametrize("crash", ["import ctypes\nctypes.string_at(0)", "import faulthandler\nfaulthandler._sigsegv()"])
def test_segfault_in_c_code_fails(verifier, clean, crash):
    passed, result = grade(verifier, f"{crash}\nprint('PWNED')")
    assert passed == [False] and result.cases[0].status == "signal"


def test_hostile_batch_rewards_zero_in_parallel(verifier, clean):
    programs = [
        "while True: pass",
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        "x = bytearray(1 << 34)",
        "import os\nos.kill(os.getppid(), 9)",
        "print('PWNED')",
    ]
    completions = [f"```python\n{p}\n```" for p in programs]
    rewards = verifier(completions, tests=[stdio()] * len(programs)).tolist()
    assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0]


# -- fail closed ------------------------------------------------------------------------------------


def test_missing_protection_refuses_with_the_opt_out_named(monkeypatch, clean):
    monkeypatch.setattr(Sandbox, "_simulate_missing", ("network",))
    with pytest.raises(SandboxRefusedError) as info:
        CodeVerifier(**LIMITS)
    message = str(info.value)
    assert "'network'" in message and "allow_missing: [network]" in message and "DANGEROUS" in message


def test_protections_that_cannot_be_opted_out(monkeypatch, clean):
    monkeypatch.setattr(Sandbox, "_simulate_missing", ("namespaces",))
    with pytest.raises(SandboxUnavailableError, match="'namespaces' is missing.*cannot be opted out"):
        Sandbox(Limits(**LIMITS), allow_missing=("network",)).check()
    with pytest.raises(ValueError, match="cannot be opted out"):
        Sandbox(allow_missing=("filesystem",))


def test_opting_out_runs_with_a_loud_warning(monkeypatch, clean, caplog):
    monkeypatch.setattr(Sandbox, "_simulate_missing", ("network",))
    with caplog.at_level(logging.WARNING):
        verifier = CodeVerifier(allow_missing=["network"], **LIMITS)
    assert any("WITHOUT PROTECTION 'network'" in r.getMessage() for r in caplog.records)
    assert verifier.run_tests("print('PWNED')", stdio())[0] == [True]
    verifier.close()


# -- as an unprivileged user ------------------------------------------------------------------------

NON_ROOT_BODY = r"""
import json, os, socket, sys
sys.path.insert(0, sys.argv[1])
from tandem_lit.verifiers import sandbox
box = sandbox.Sandbox(sandbox.Limits(timeout_s=1.0, completion_timeout_s=4.0, memory_mb=256, max_processes=8))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(5)
listener.settimeout(0.3)
port = listener.getsockname()[1]
bomb = "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(100)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)\nprint('PWNED')"
out = {"uid": os.getuid(), "skipped": box.check()}
for name, program in (("bomb", bomb), ("connect", connect)):
    result = box.run({"kind": "stdio", "program": program, "cases": [{"stdin": ""}]})
    out[name] = [result.cases[0].status, result.cases[0].stdout]
try:
    listener.accept()
    out["connection"] = True
except socket.timeout:
    out["connection"] = False
mine = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
out["strays"] = [p for p in mine if sandbox.DRIVER_MARK.encode() in open(f"/proc/{p}/cmdline", "rb").read()]
print(json.dumps(out))
"""

NOBODY = 65534
NOBODY_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}

# Root starts the unprivileged run when `nobody` cannot reach the interpreter (pyenv under /root, a
# home folder of mode 0700): in a private mount namespace, a tmpfs is laid over the first closed
# folder above the interpreter's installation and the installation is bound back into it.
AS_NOBODY = r"""
import ctypes, os, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
def check(ok, what):
    if ok != 0:  # (no CAP_SYS_ADMIN, e.g. an unprivileged container's root)
        sys.exit(f"cannot mount: {what}: {os.strerror(ctypes.get_errno())}")
prefix = os.path.realpath(sys.base_prefix)
ancestors = ["/" + "/".join(prefix.split("/")[1:i]) for i in range(2, prefix.count("/") + 1)]
closed = next((folder for folder in ancestors if not os.stat(folder).st_mode & stat.S_IXOTH), None)
check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
check(libc.mount(None, b"/", None, (1 << 14) | (1 << 18), None), "mount --make-rprivate /")
if closed is not None:
    fd = os.open(prefix, os.O_PATH)
    check(libc.mount(b"tmpfs", closed.encode(), b"tmpfs", 0, b"mode=0755"), f"mount tmpfs on {closed}")
    os.makedirs(prefix)
    check(libc.mount(f"/proc/self/fd/{fd}".encode(), prefix.encode(), None, 4096 | (1 << 14), None), f"bind {prefix}")
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
os.chdir("/")
os.execve(sys.executable, [sys.executable, "-I", "-c", sys.argv[1], sys.argv[2]], {"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
"""


def why_nobody_cannot_run(python: str) -> str | None:
    """None when `nobody` can exec ``python`` and import what the test body needs, else why not."""
    try:
        done = subprocess.run([python, "-I", "-c", "import ctypes, json, socket"], user=NOBODY, group=NOBODY,
                              extra_groups=[], cwd="/", env=NOBODY_ENV, capture_output=True, text=True, timeout=60)
    except OSError as err:  # the exec itself was refused
        return str(err)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]


def readable_copy() -> str:
    """The sandbox's two modules, copied as a bare ``tandem_lit.verifiers`` package where `nobody`
    can read them (the repository may live in a closed home; the real package imports torch)."""
    folder = tempfile.mkdtemp(prefix="sandbox-test-")
    package = Path(folder, "tandem_lit", "verifiers")
    package.mkdir(parents=True)
    for module in (sandbox_module, sandbox_child):
        Path(package, Path(module.__file__).name).write_bytes(Path(module.__file__).read_bytes())
    for init in (package.parent / "__init__.py", package / "__init__.py"):
        init.write_text("")
    for path in (folder, *Path(folder).rglob("*")):
        os.chmod(path, 0o755 if Path(path).is_dir() else 0o644)
    return folder


def test_unprivileged_user_path():
    """The non-root path (a CI runner without root): the fork bomb is capped by RLIMIT_NPROC in
    the sandbox's own user namespace, and a connection attempt fails. As root the test runs
    itself as `nobody`, with the interpreter's real binary (a venv's python is a symlink that may
    sit anywhere) and a readable copy of the sandbox's two modules, wherever the venv and the checkout
    live."""
    python = os.path.realpath(sys.executable)
    package = readable_copy()
    try:
        if os.geteuid() == 0:
            closed = why_nobody_cannot_run(python)
            if closed is None:
                done = subprocess.run([python, "-I", "-c", NON_ROOT_BODY, package], capture_output=True, text=True,
                                      timeout=60, user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env=NOBODY_ENV)
            else:
                done = subprocess.run([python, "-I", "-c", AS_NOBODY, NON_ROOT_BODY, package], capture_output=True,
                                      text=True, timeout=60)
                if done.stderr.startswith("cannot mount:"):
                    pytest.skip(f"`nobody` cannot exec {python} ({closed}), and this root cannot bind it into a "
                                f"private mount namespace ({done.stderr.strip()})")
        else:
            done = subprocess.run([sys.executable, "-I", "-c", NON_ROOT_BODY, package], capture_output=True,
                                  text=True, timeout=60)
    finally:
        shutil.rmtree(package)
    if done.returncode != 0 and "refuses" in done.stderr:
        pytest.skip(f"no unprivileged sandbox on this machine: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["uid"] != 0 and out["skipped"] == []
    status, stdout = out["bomb"]
    assert status == "ok" and int(stdout) < LIMITS["max_processes"], out  # fork failed at the limit
    assert out["connect"][0] == "error" and out["connect"][1] == ""
    assert out["connection"] is False
    assert out["strays"] == []
