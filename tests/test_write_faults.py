"""A run that cannot write: the disk fills, the run folder turns read only, mid-run. It ends with one
line (what failed, why, the intact checkpoint, the resume command), keeps whole what it saved
before (checkpoints, history, completions, run.json, the MLflow store), and resumes once the disk
is fixed.

On a small tmpfs where this machine lets a test mount one (root), else the same faults injected
into the writes, so CI runs the lines either way."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch

from tandem_lit.cli import main

pytestmark = [pytest.mark.filterwarnings("ignore:No seed found"), pytest.mark.usefixtures("in_repo"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

FAST = [
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--trainer.limit_val_batches", "0", "--model.init_args.evaluation.at_start", "false",
    "--data.init_args.batch_size", "2", "--model.init_args.rollout.sampling.n", "2",
    "--model.init_args.rollout.sampling.max_new_tokens", "12", "--model.init_args.logging.completions_every_n_steps", "1",
    "--checkpoint.every_n_train_steps", "2", "--trainer.max_steps", "4",
]


def fit(root: Path, *extra: str) -> None:
    """The tiny run with the default logger: an MLflow store in the run folder."""
    main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(root), *FAST, *extra])


def at_step(name: str, step: int, path: Path) -> list[str]:
    return ["--trainer.callbacks", json.dumps([{"class_path": f"test_write_faults.{name}",
                                                "init_args": {"step": step, "path": str(path)}}])]


class FillDisk(L.Callback):
    """Fills the file system of ``path`` when training step ``step`` (0-based) begins."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            fill(self.path / "filler")


class ReadOnly(L.Callback):
    """Makes the folder ``path`` read only when training step ``step`` begins: a read-only bind
    mount over it (a remount of the file system itself is refused while files are open to write)."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            subprocess.run(["mount", "--bind", self.path, self.path], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", self.path], check=True)


def fill(path: Path) -> None:
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not root'}); the injected faults below "
                    "test the same lines")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def the_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("tandem-lit: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and err.rstrip().splitlines()[-1] == lines[0], err[-3000:]
    return lines[0]


def stopped_line(capsys, root: Path, *args: str) -> str:
    """The one line a fit run into a write fault stops with (exit code 2)."""
    with pytest.raises(SystemExit) as stopped:
        fit(root, *args)
    assert stopped.value.code == 2
    return the_line(capsys.readouterr().err)


def assert_saved_runs_are_whole(root: Path, updates: int) -> None:
    """What the run saved before the fault reads back: the checkpoint, run.json, every line of
    completions.jsonl, the MLflow store with the metrics of the steps before; no partial files."""
    from mlflow.tracking import MlflowClient

    assert torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == updates
    record = json.loads((root / "run.json").read_text())
    completions = [json.loads(line) for line in (root / "completions.jsonl").read_text().splitlines()]
    assert completions and {c["run_id"] for c in completions} == {record["run_id"]}
    assert not [p for p in root.rglob("*") if p.name.endswith(".partial")]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    steps = {m.step for m in client.get_metric_history(record["mlflow_run_id"], "train/loss")}
    assert set(range(1, updates + 1)) <= steps


def resume_and_finish(root: Path) -> None:
    fit(root, "--ckpt_path", str(root / "checkpoints" / "last.ckpt"))
    history = [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history if "train/loss" in row] == [1, 2, 3, 4]
    assert len({row["run_id"] for row in history}) == 1


def test_a_disk_that_fills_mid_run_ends_in_one_line_and_the_run_resumes(small_disk, capsys):
    root = small_disk / "run"
    line = stopped_line(capsys, root, *at_step("FillDisk", 2, small_disk))
    assert "no space left on the device" in line and "cannot write " in line
    assert f"{root / 'checkpoints' / 'last.ckpt'} (update 2) is intact" in line
    assert line.endswith(f"then resume with --ckpt_path {root / 'checkpoints' / 'last.ckpt'}")
    assert_saved_runs_are_whole(root, 2)
    (small_disk / "filler").unlink()
    resume_and_finish(root)


def test_a_run_folder_turned_read_only_mid_run_ends_in_one_line_and_the_run_resumes(small_disk, capsys):
    root = small_disk / "run"
    line = stopped_line(capsys, root, *at_step("ReadOnly", 2, root))
    assert "the file system is read only" in line, line
    assert f"{root / 'checkpoints' / 'last.ckpt'} (update 2) is intact" in line
    assert_saved_runs_are_whole(root, 2)
    subprocess.run(["umount", str(root)], check=True)  # writable again
    resume_and_finish(root)


# -- the same faults injected into the writes (no mount needed: these run everywhere) ------------------


class HalfWriter:
    """A file whose next write puts down half its data and then finds the disk full."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        self._file.write(data[: len(data) // 2])
        self._file.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def faulty_writes(monkeypatch, matches, fault: int) -> None:
    """Python's writes to files ``matches`` accepts fail with ``fault``: EROFS when opened, ENOSPC
    half-way through the first write."""
    real = io.open

    def opened(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and isinstance(file, (str, os.PathLike)) and matches(Path(file)):
            if fault == errno.EROFS:
                raise OSError(fault, os.strerror(fault), str(file))
            return HalfWriter(real(file, mode, *args, **kwargs))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", opened)
    monkeypatch.setattr(builtins, "open", opened)


@pytest.mark.parametrize("fault", ["no space left on the device", "out of host memory"])
def test_a_checkpoint_write_that_finds_the_disk_full_keeps_the_last_one_and_says_so(tmp_path, capsys, monkeypatch, fault):
    """torch's zip writer reports a full disk as a RuntimeError over the OSError: the second
    checkpoint (update 4) fails half-way; update 2's stays, whole, and the run resumes from it.
    The same when the host runs out of memory while the checkpoint is pickled."""
    root = tmp_path / "run"
    real_save, saves = torch.save, []

    def save(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) < 2:
            return real_save(obj, f, *args, **kwargs)
        f.write(b"PK\x03\x04 half a checkpoint")
        if fault == "out of host memory":
            raise MemoryError()
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    monkeypatch.setattr(torch, "save", save)
    line = stopped_line(capsys, root)
    last = root / "checkpoints" / "last.ckpt"
    assert line.startswith(f"tandem-lit: error: cannot write checkpoint {last}: {fault}. ")
    assert f"{last} (update 2) is intact" in line and line.endswith(f"then resume with --ckpt_path {last}")
    monkeypatch.setattr(torch, "save", real_save)
    assert_saved_runs_are_whole(root, 2)
    resume_and_finish(root)


def test_a_run_folder_read_only_from_the_start_is_one_line_with_no_checkpoint_to_resume(tmp_path, capsys, monkeypatch):
    root = tmp_path / "run"
    root.mkdir()
    faulty_writes(monkeypatch, lambda path: root in path.parents, errno.EROFS)
    line = stopped_line(capsys, root, "--trainer.logger", "false")
    assert f"cannot write {root}" in line
    assert line.endswith("the file system is read only; no checkpoint was saved yet: make the run folder writable, "
                         "then start the run again")


def test_a_full_disk_keeps_a_resumed_runs_history_and_completions_whole(tmp_path, capsys, monkeypatch):
    """completions.jsonl is appended at each step: a full disk never leaves half a line in it.
    history.jsonl is rewritten at the end of a run: a full disk then leaves the earlier rows, not
    a truncated file."""
    root = tmp_path / "run"
    resume = ["--trainer.logger", "false", "--ckpt_path", str(root / "checkpoints" / "last.ckpt")]
    fit(root, "--trainer.logger", "false", "--trainer.max_steps", "2")
    history, completions = (root / "history.jsonl").read_text(), (root / "completions.jsonl").read_text()
    for name in ("completions.jsonl", "history.jsonl"):
        with monkeypatch.context() as patched:
            faulty_writes(patched, lambda path, name=name: name in path.name, errno.ENOSPC)
            capsys.readouterr()
            with pytest.raises(SystemExit):
                fit(root, *resume)
        line = the_line(capsys.readouterr().err)
        assert f"cannot write {root / name}: no space left on the device" in line
        assert (root / "history.jsonl").read_text() == history  # (the run that reached its end wrote no new rows)
        if name == "completions.jsonl":  # the step that failed added nothing
            assert (root / "completions.jsonl").read_text() == completions
        assert all(json.loads(line) for line in (root / "completions.jsonl").read_text().splitlines())


@pytest.mark.parametrize("where", ["shards", "metadata"])
def test_a_sharded_checkpoint_that_finds_the_disk_full_leaves_the_last_one_and_its_space(tmp_path, monkeypatch, where):
    """``checkpoint.sharded``: a save whose shards (DCP, which reports every rank's error in a
    CheckpointException) or whose metadata (rank 0) meet a full disk removes its partial folder,
    so the space comes back, and raises the disk's error; ``last.ckpt`` still points at the
    previous checkpoint, whole. (One process here: the ranks' agreement is DCP's collective and
    the broadcast of rank 0's error.)"""
    from torch.distributed.checkpoint.api import CheckpointException

    from tandem_lit.training import sharded
    from tandem_lit.training.callbacks import read_checkpoint

    def save(step: int) -> None:
        checkpoint = {"global_step": step, "state_dict": {"w": torch.full((4,), float(step))}, "optimizer_states": []}
        sharded.save_sharded(checkpoint, tmp_path / "last.ckpt", 0, lambda value: value, lambda: None)

    save(1)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "shards":
        def dcp_save(state, checkpoint_id):
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
            raise CheckpointException("save failed", {0: (full, None)})
        monkeypatch.setattr(sharded.dcp, "save", dcp_save)
    else:
        def torch_save(obj, f, *args, **kwargs):
            raise full
        monkeypatch.setattr(sharded.torch, "save", torch_save)
    with pytest.raises(OSError) as stopped:
        save(2)
    assert stopped.value.errno == errno.ENOSPC
    assert not list(tmp_path.glob(".last.ckpt.*")), "the partial folder is removed"
    assert os.readlink(tmp_path / "last.ckpt").startswith("last.ckpt.1-")
    assert torch.equal(read_checkpoint(tmp_path / "last.ckpt")["state_dict"]["w"], torch.full((4,), 1.0))
