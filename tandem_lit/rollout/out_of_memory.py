"""A CUDA out-of-memory in a step, as one line: the phase it happened in and the setting to lower.

The memory plan (``training.memory``) stops a run that would not fit before its first step; what
it does not foresee still ends as ``torch.OutOfMemoryError`` deep inside a forward. ``phase``
turns that into a ``DeviceMemoryError`` naming where (rollout prefill, rollout decode, update,
evaluation) and what to lower, with the request that failed and what PyTorch held. The traceback
and the allocator's state at that moment go to ``out_of_memory.txt`` in the run folder, for what a
line cannot say: which tensors held the memory (``tensor_census``: the live tensors on the device
by what they are, and what no Python object holds, such as the autograd graph's saved
activations). Nothing else is saved on the way out: the last checkpoint stays the one written
after the last finished step (a step cut short is not a state to resume from).
"""

from __future__ import annotations

import gc
import os
import re
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tandem_lit.errors import DeviceMemoryError
from tandem_lit.write_faults import write_atomically

REPORT = "out_of_memory.txt"  # in the run folder

# functions of the engines' prefill path (FastEngine's refill: continuous.py -> plain.py / hybrid.py -> blocks.py)
PREFILL_FRAMES = {"_admit", "_prefill_forward", "prefill_forward", "prefill_with_cache", "prefill", "_place", "store_prefill"}
ALLOCATION_FRAMES = {"_ensure_capacity", "allocate"}  # the KV pool and decode buffers, made at a generate's start

ADVICE = {
    "rollout prefill": "lower engine.prefill_tokens (padded positions one prefill holds) or the KV pool "
                       "(engine.kv_cache_gib / kv_cache_tokens); kv_cache_gib: auto sizes both from the card",
    "rollout KV pool allocation": "lower the KV pool (engine.kv_cache_gib / kv_cache_tokens) or rollout.batch_size; "
                                  "kv_cache_gib: auto sizes the pool from the card",
    "rollout decode": "lower the KV pool (engine.kv_cache_gib / kv_cache_tokens) or rollout.batch_size; "
                      "kv_cache_gib: auto sizes the pool from the card",
    "update": "lower memory.micro_batch_tokens (tokens one pass holds) or memory.forward_only_pass_scale",
    "evaluation": "lower data.eval_batch_size / data.batch_size (rows an evaluation batch rolls out) or the KV pool "
                  "(engine.kv_cache_gib / kv_cache_tokens)",
}


def rollout_part(err: BaseException) -> str:
    """Which part of a rollout ran out: its prefill, the pool's allocation or the decode steps
    (read from the functions the error went through)."""
    names = {frame.name for frame in traceback.extract_tb(err.__traceback__)}
    if names & PREFILL_FRAMES:
        return "rollout prefill"
    if names & ALLOCATION_FRAMES:
        return "rollout KV pool allocation"
    return "rollout decode"


def last_checkpoint(trainer) -> str | None:
    """The newest ``last.ckpt`` this run wrote or resumed from, if any."""
    if trainer is None:
        return None
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        path = getattr(callback, "last_model_path", "") or ""
        if path and Path(path).exists():
            return path
    resumed = getattr(trainer, "ckpt_path", None)
    return str(resumed) if resumed and Path(str(resumed)).exists() else None


# the sizes PyTorch's message writes (c10's format_size), and the two of them read here
_UNITS = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
_SIZE = r"(([\d.]+) (bytes|KiB|MiB|GiB|TiB))"
REQUEST = re.compile(rf"Tried to allocate {_SIZE}")
IDLE = re.compile(rf"{_SIZE} is reserved by PyTorch but unallocated")
ALLOCATED = re.compile(rf"{_SIZE} is allocated by PyTorch")
# The least share of PyTorch's reserved memory that, idle, makes fragmentation the cause: an allocator
# always keeps a sliver idle (1.34 of 78.4 GiB when the Qwen3.5 LoRA update on an H100 named it, and
# the same run with expandable segments stopped at the same place).
FRAGMENTED_SHARE = 0.05


def _bytes(match: re.Match) -> float:
    return float(match.group(2)) * _UNITS[match.group(3)]


def fragmented(err: BaseException) -> str | None:
    """How much memory PyTorch's message says was reserved but unallocated (e.g. '7.11 GiB'),
    where that is at least the request that failed and ``FRAGMENTED_SHARE`` of what PyTorch
    reserved: memory the allocator held in pieces none of which fit it (fragmentation, which
    expandable segments avoid); None otherwise, or where the run already sets them."""
    text = str(err)
    request, idle, allocated = REQUEST.search(text), IDLE.search(text), ALLOCATED.search(text)
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if request is None or idle is None or _bytes(idle) < _bytes(request) or "expandable_segments:true" in settings.lower():
        return None
    if allocated is not None and _bytes(idle) < FRAGMENTED_SHARE * (_bytes(idle) + _bytes(allocated)):
        return None
    return idle.group(1)


def memory_line(phase: str, err: BaseException, device, trainer=None, checkpointing: bool | None = None) -> str:
    where = rollout_part(err) if phase == "rollout" else phase
    advice = ADVICE[where]
    if where == "update" and not checkpointing:  # (a run that checkpoints already is not told to)
        advice += ", or set memory.gradient_checkpointing: true"
    if idle := fragmented(err):
        advice = (f"{idle} was reserved but unallocated, in pieces too small for the request: start the run with "
                  f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (no fragmentation), or {advice}")
    held = []
    if request := REQUEST.search(str(err)):
        held.append(f"a request of {request.group(1)}")
    if isinstance(device, torch.device) and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        held.append(f"{torch.cuda.memory_allocated(device) / 1024**3:.1f} GiB allocated, "
                    f"{torch.cuda.memory_reserved(device) / 1024**3:.1f} of {total / 1024**3:.1f} GiB reserved by PyTorch")
    held = f" ({'; '.join(held)})" if held else ""
    checkpoint = last_checkpoint(trainer)
    kept = (f"the last checkpoint, {checkpoint}, is intact: resume with --ckpt_path {checkpoint}" if checkpoint
            else "no checkpoint was written before it")
    return f"CUDA out of memory in the {where}{held}: {advice}; {kept}"


@contextmanager
def phase(name: str, device, trainer=None, checkpointing: bool | None = None) -> Iterator[None]:
    """Raise ``DeviceMemoryError`` (one line) for a ``torch.OutOfMemoryError`` inside: ``name`` is
    ``rollout`` (refined to prefill, pool allocation or decode), ``update`` or ``evaluation``;
    ``checkpointing``: whether the update already runs with gradient checkpointing."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        line = memory_line(name, err, device, trainer, checkpointing)
        if report := write_report(line, err, device, trainer):
            line += f" (traceback and allocator state: {report})"
        raise DeviceMemoryError(line) from err


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory under ``tensor``: views of one storage count once."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    return tensor.device.type == device.type and (device.type != "cuda" or tensor.device.index == index)


def known_tensors(trainer) -> dict[str, Iterable[torch.Tensor]]:
    """The tensors a run knows by role: the trained senior's parameters and buffers, their
    gradients, the optimizer's state, the junior, the reference, the engine's rollout copy."""
    module = getattr(trainer, "lightning_module", None)
    if module is None:
        return {}

    def of(model):
        return [] if not isinstance(model, torch.nn.Module) else [*model.parameters(), *model.buffers()]

    senior = getattr(module, "senior", None)
    optimizers = getattr(trainer, "optimizers", None) or []
    return {
        "senior (trained) weights": of(senior),
        "gradients": [p.grad for p in of(senior) if getattr(p, "grad", None) is not None],
        "optimizer state": [v for opt in optimizers for state in opt.state.values()
                            for v in state.values() if isinstance(v, torch.Tensor)],
        "junior weights": of(getattr(module, "junior", None)),
        "reference weights": of(getattr(module, "reference", None)),
        "rollout copy of the senior": of(getattr(getattr(module, "engine", None), "senior", None)),
    }


def tensor_census(device: torch.device, known: dict[str, Iterable[torch.Tensor]], allocated: int | None = None,
                  top: int = 20) -> str:
    """The memory of every live tensor on ``device`` that a Python object holds, each storage
    counted once: those in ``known`` by role, the others grouped by shape and dtype (largest
    first, ``top`` of them). With ``allocated`` (the allocator's bytes in use), also what no
    Python object holds: the autograd graph's saved activations, CUDA graph pools, workspaces."""
    role = {}
    for label, tensors in known.items():
        for tensor in tensors:
            if _on(tensor, device):
                role.setdefault(_storage(tensor)[0], label)
    live: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        try:
            # (type(), not isinstance: that would read __class__, which some module proxies warn on)
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta or not _on(obj, device):
                continue
            address, size = _storage(obj)
        except (ReferenceError, RuntimeError):  # (a dead proxy, a tensor without storage)
            continue
        if address not in live:
            live[address] = size, role.get(address) or f"other {tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    groups: dict[str, list[int]] = {}
    for size, label in live.values():
        group = groups.setdefault(label, [0, 0])
        group[0] += size
        group[1] += 1
    seen = sum(size for size, _ in live.values())
    lines = [f"live tensors on {device} held by Python objects: {_size(seen)} in {len(live)} storages"]
    if allocated is not None:
        lines.append(f"allocated but held by no Python object (the autograd graph's saved tensors, CUDA graph pools, "
                     f"workspaces): {_size(max(allocated - seen, 0))}")
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    for label, (size, count) in ranked[:top]:
        lines.append(f"  {_size(size):>12}  {count:5d} x  {label}")
    if len(ranked) > top:
        rest = sum(size for _, (size, _) in ranked[top:])
        lines.append(f"  {_size(rest):>12}  in {len(ranked) - top} smaller groups")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    if nbytes >= 1024**3:
        return f"{nbytes / 1024**3:.2f} GiB"
    return f"{nbytes / 1024**2:.2f} MiB" if nbytes >= 1024**2 else f"{nbytes} bytes"


def write_report(line: str, err: BaseException, device, trainer) -> Path | None:
    """``REPORT`` in the run folder: the line, the traceback and (on CUDA) the tensors that held the
    device (``tensor_census``) and the allocator's summary, as the error left them. None where
    there is no run folder or it cannot be written (the one line still goes out)."""
    folder = getattr(trainer, "default_root_dir", None)
    if folder is None or not Path(folder).is_dir():
        return None
    parts = [line, "".join(traceback.format_exception(err))]
    if isinstance(device, torch.device) and device.type == "cuda":
        parts.append(tensor_census(device, known_tensors(trainer), torch.cuda.memory_allocated(device)))
        parts.append(torch.cuda.memory_summary(device))
    path = Path(folder) / REPORT
    try:
        write_atomically(path, "\n\n".join(parts))
    except OSError:  # (RunWriteError is one: a full or read-only disk)
        return None
    return path
