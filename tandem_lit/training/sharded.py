"""Sharded checkpoints (``checkpoint.sharded: true`` with ``trainer.strategy: fsdp``): every rank
writes its own shards of the trained weights and optimizer state in parallel
(``torch.distributed.checkpoint``), instead of gathering full tensors to rank 0 into one file.

A checkpoint ``checkpoints/last.ckpt`` is then a symlink to a folder ``last.ckpt.<step>-<token>``:

    .metadata  __<rank>_0.distcp ...   the shards (DCP's format: reshardable onto any world size)
    meta.pt                            everything else Lightning keeps (loops, callbacks, history)

Atomic as a whole: the ranks write into ``.last.ckpt.<step>-<token>.partial``; when every rank has
finished (DCP's save ends in a collective), rank 0 adds ``meta.pt``, renames the folder, and only
then moves the ``last.ckpt`` link onto it and deletes the folder it pointed to before. A crash at
any moment leaves ``last.ckpt`` on a complete checkpoint. The folder resumes on any number of
processes (one process reads full tensors from it: ``read_checkpoint``) and ``tandem-lit export``
reads it like a file.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tandem_lit.write_faults import write_fault

META = "meta.pt"


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


def save_sharded(checkpoint: dict[str, Any], path: str | Path, rank: int, broadcast: Callable[[Any], Any],
                 barrier: Callable[[], None]) -> Path:
    """Write ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` sharded, FQN-keyed) as the
    folder ``path`` will point to; every rank calls this. Returns the folder."""
    path = Path(path)
    token = broadcast(uuid.uuid4().hex[:8])
    folder = path.with_name(f"{path.name}.{checkpoint.get('global_step', 0)}-{token}")
    partial = path.with_name(f".{folder.name}.partial")
    if rank == 0:
        for stale in path.parent.glob(f".{path.name}.*.partial"):  # a save killed half-way
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    try:
        dcp.save(tensors, checkpoint_id=partial)  # returns on every rank once all shards and .metadata are written
    except BaseException as err:  # (DCP's CheckpointException, raised on every rank, holds each rank's error)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a full disk gets its space back
        faults = [failure for failure, _ in getattr(err, "failures", {}).values() if write_fault(failure)]
        if faults:
            raise faults[0] from None
        raise
    refused = None
    if rank == 0:
        try:
            with open(partial / META, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync(partial)
            os.rename(partial, folder)
            point(path, folder)
        except Exception as err:  # told to every rank: none is left waiting in the barrier
            shutil.rmtree(partial, ignore_errors=True)
            refused = err if write_fault(err) else RuntimeError(f"writing checkpoint {folder} failed: {err!r}")
    refused = broadcast(refused)
    if refused is not None:
        raise refused
    barrier()
    return folder


def point(path: Path, folder: Path) -> None:
    """Move the pointer ``path`` onto ``folder`` atomically (a symlink renamed over it), then remove
    what it pointed to before (a shards folder, or a one-file checkpoint that the link replaces)."""
    before = Path(os.path.realpath(path)) if path.is_symlink() else None
    if path.is_dir() and not path.is_symlink():  # a folder of another layout: cannot be renamed over
        shutil.rmtree(path)
    link = path.with_name(f".{path.name}.{folder.name}.link")
    link.unlink(missing_ok=True)
    os.symlink(folder.name, link)
    os.replace(link, path)
    _fsync(path.parent)
    if before is not None and before != folder.resolve() and before.name.startswith(f"{path.name}.") and before.is_dir():
        shutil.rmtree(before, ignore_errors=True)


def remove_sharded(path: str | Path) -> None:
    """Delete a checkpoint pointer and the shards folder it points to (a superseded best checkpoint)."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else None
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if target is not None and target.is_dir():
        shutil.rmtree(target, ignore_errors=True)


def load_sharded_into(path: str | Path, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Load a sharded checkpoint into ``module``'s (FSDP-sharded) parameters and ``optimizers``'
    state on any number of ranks (DCP reshards); returns the rest of the checkpoint. Only the tensors
    the checkpoint holds (the trainable ones) are read: the others come from the models' sources."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path).resolve()
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    current = get_model_state_dict(module)
    saved = meta.get("tandem_lit", {}).get("trainable_keys") or list(current)
    missing = sorted(set(saved) - set(current))
    if missing:
        raise RuntimeError(
            f"checkpoint {path} does not match this model: it holds {len(missing)} tensors this model lacks "
            f"(e.g. {missing[:3]}); load it with the same senior and lora settings it was trained with"
        )
    wanted = {"state_dict": {key: current[key] for key in saved}}
    dcp.load(wanted, checkpoint_id=path)
    set_model_state_dict(module, wanted["state_dict"], options=StateDictOptions(strict=False))
    for i, optimizer in enumerate(optimizers):
        state = {f"optimizer_{i}": get_optimizer_state_dict(module, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"])
    return meta


def read_sharded(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint as one process's full checkpoint dict (full tensors, optimizer states
    keyed by parameter index as ``Optimizer.state_dict`` keys them), with no process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path).resolve()
    checkpoint = torch.load(path / META, map_location="cpu", weights_only=False)
    tensors: dict[str, Any] = {}
    _load_state_dict(tensors, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    checkpoint["state_dict"] = tensors["state_dict"]
    optimizers = sorted((int(k.removeprefix("optimizer_")), v) for k, v in tensors.items() if k.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [by_index(state) for _, state in optimizers]
    return checkpoint


def by_index(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (DCP's) keyed by index instead, in the order of
    its param groups (the order ``Optimizer.load_state_dict`` expects)."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    groups, start = [], 0
    for group in state["param_groups"]:
        groups.append({**group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
