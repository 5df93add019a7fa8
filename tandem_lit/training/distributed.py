"""Several processes (GPUs, or gloo processes on a CPU): FSDP2 for the senior, rollouts on every rank.

``trainer.strategy: fsdp`` means :class:`FSDP2Strategy`, Lightning's ModelParallelStrategy (FSDP2,
``torch.distributed.fsdp.fully_shard``) with every process in one data-parallel group. FSDP2
rather than Lightning's FSDPStrategy (FSDP1) because its parameters are plain DTensors: LoRA's
frozen base and trainable adapters share a module without ``use_orig_params``, a layer can be
gathered on its own (``unshard``) to fill the rollout copy, and optimizer state is sharded per
parameter. The frozen junior is never sharded: every rank holds a full copy for inference.

How a step runs on W ranks (``TandemModule`` calls the helpers below):
- every rank iterates the same global batches (one resumable loader state) and decides alike
  which prompts fit ``max_prompt_tokens``; rank r keeps its share of each PPO mini-batch
  (``rank_rows``, through ``Shares``), with the seeds those rows get in one process, so a prompt's
  rollouts stay on one rank and group advantages need no communication;
- dynamic sampling: each round's rows are split over the ranks, the ranks add up which groups have
  reward spread, so all keep the groups one process keeps, and the kept groups are dealt out
  again as ``rank_rows`` of them (``Shares.deal``); a step trains a multiple of W groups;
- the rollout copy is filled once per rollout phase from the gathered shards (``gathered``);
- the loss is normalised by batch-wide totals (``all_reduce_sum``) and multiplied by W,
  since FSDP averages gradients over ranks: the update equals the one-process update;
- every rank runs as many forward/backward passes as the busiest one (``balance``);
- metrics are reduced over ranks (``reduce_metrics``, eval tallies ``evaluation.report.merge_totals``); files are
  written by rank 0.
"""

from __future__ import annotations

import functools
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from tandem_lit.errors import ConfigError, ProcessGroupError
from tandem_lit.rollout.logprobs import last_hidden_state
from tandem_lit.rollout.weights import is_sharded, plain_model
from tandem_lit.training.sharded import is_sharded_checkpoint, load_sharded_into, remove_sharded, save_sharded
from tandem_lit.write_faults import fault_line, run_write_error, write_fault

# metrics that add up over ranks (counts, throughput) or take the largest; the rest are means
# (``loss``: each rank's part of the batch-wide normalised loss; counts every rank takes of the
# whole batch, such as ``skipped_long_prompts`` and ``kept_groups``, are the same on every rank)
SUMMED = {"loss", "grader_timeouts", "tokens_per_second"}
LARGEST = {"peak_memory_gb", "rollout_peak_memory_gb", "update_peak_memory_gb"}


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's FSDP2 strategy with one data-parallel group of every process (no tensor
    parallelism). Checkpoints are one file of full weights and optimizer state, gathered to rank 0
    and written atomically; with ``sharded_checkpoints`` (``checkpoint.sharded: true``) a folder
    in which every rank writes its own shards (``training/sharded.py``). Either loads on any number
    of processes and exports to a Hugging Face folder."""

    def __init__(self, sharded_checkpoints: bool = False, **kwargs: Any) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=sharded_checkpoints,
                         **kwargs)

    @property
    def sharded_checkpoints(self) -> bool:
        return self._save_distributed_checkpoint

    @sharded_checkpoints.setter
    def sharded_checkpoints(self, value: bool) -> None:
        self._save_distributed_checkpoint = value  # what Lightning's state-dict getters read

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        if not self.sharded_checkpoints:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        try:
            save_sharded(checkpoint, path, self.global_rank, self.broadcast, self.barrier)
        except Exception as err:  # a full disk, a read-only folder: every rank stops with one line
            fault = write_fault(err)
            if fault is None:
                raise
            raise fault_line(fault[0], f"checkpoint {path}", None, path.parent / "last.ckpt") from err

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if is_sharded_checkpoint(path):
            return load_sharded_into(path, self.lightning_module, self.optimizers)
        return super().load_checkpoint(path, weights_only)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            remove_sharded(filepath)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Build the models in ``configure_model`` on this rank's device, as one process does
        (Lightning's FSDP2 builds them on the CPU: a random 4B senior took minutes there); the
        senior is then sharded where it is, the junior stays whole."""
        with torch.device(self.root_device), self.precision_plugin.tensor_init_context():
            yield


def external_launch() -> tuple[int, int] | None:
    """(processes per node, nodes) when a launcher started this process with the others (torchrun,
    or SLURM's srun: the environments Lightning's TorchElasticEnvironment and SLURMEnvironment
    read), else None (Lightning starts the processes itself)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env and "WORLD_SIZE" in env:
        world, local = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        return local, max(world // local, 1)
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", "1"))
        local = int(env.get("SLURM_NTASKS_PER_NODE", str(world // nodes)).split("(")[0])
        return local, nodes
    return None


def launch_settings(devices: Any, num_nodes: int) -> tuple[Any, int]:
    """``trainer.devices`` and ``trainer.num_nodes`` for this launch: an external launcher's
    (where the config leaves them at 1 or "auto", or agrees), or the config's as they are. A
    config that disagrees with the launcher, or asks for several nodes without one, is refused
    with one line (else the processes would wait for a rendezvous that never completes)."""
    launched = external_launch()
    if launched is None:
        if num_nodes > 1:
            raise ConfigError(
                f"trainer.num_nodes is {num_nodes}, but no launcher started this process: start every node's "
                "processes with torchrun or srun (docs/distributed.md), or set trainer.num_nodes: 1"
            )
        return devices, num_nodes
    local, nodes = launched
    if devices not in (1, "1", "auto", local, str(local)) or num_nodes not in (1, nodes):
        raise ConfigError(
            f"the launcher started {local} process(es) on each of {nodes} node(s), but the config asks for "
            f"trainer.devices {devices} and trainer.num_nodes {num_nodes}: leave them out (the launcher's count is "
            f"used) or set --trainer.devices {local} --trainer.num_nodes {nodes}"
        )
    return local, nodes


def launch_rank() -> int:
    """This process's global rank as its launcher set it (torchrun, srun, or Lightning's own
    launcher on one node; 0 for the first or only process), before any process group exists."""
    env = os.environ
    return int(env.get("RANK", env.get("SLURM_PROCID", env.get("LOCAL_RANK", "0"))))


def check_run_folder(folder: str | Path) -> None:
    """Every rank writes to one run folder: the same path on every rank, on a file system they all
    see (rank 0 writes the files, every rank its shards of a sharded checkpoint). Each rank looks
    for a file rank 0 just wrote; all ranks decide together, so none is left waiting."""
    folder = Path(folder)
    token, refused = uuid.uuid4().hex, None
    probe = folder / f".rank0-{token}"
    if dist.get_rank() == 0:  # (a Trainer built in code may name a folder nothing created yet)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
        except OSError as err:  # said by every rank below: none is left waiting for rank 0
            refused = run_write_error(err, folder) or ConfigError(f"cannot write the run folder {folder}: {err}")
    shared = [(token, refused)]
    dist.broadcast_object_list(shared)
    token, refused = shared[0]
    probe = folder / f".rank0-{token}"  # (each rank looks in the folder it chose)
    if refused is not None:
        raise refused
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (str(folder.resolve()), probe.exists()))
    dist.barrier()
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    folders = {path for path, _ in views}
    if len(folders) > 1:
        raise ConfigError(f"the ranks chose different run folders ({sorted(folders)}): pass --trainer.default_root_dir "
                          "the same folder on every node")
    blind = [rank for rank, (_, seen) in enumerate(views) if not seen]
    if blind:
        raise ConfigError(f"rank(s) {blind} cannot see the files rank 0 writes in {folder}: put the run folder on a file "
                          "system every node shares")


# how gloo and NCCL report a peer that is gone (killed, crashed, out of memory)
LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
             "communicator was aborted")


def process_group_error(err: BaseException) -> ProcessGroupError | None:
    """One line for the faults of several processes a user can act on: the port rank 0 listens on
    is taken, or another rank stopped (this one then fails in its next collective)."""
    from tandem_lit.write_faults import chain, describe_checkpoint

    for link in chain(err):
        if not raised_by_torch_distributed(link):  # (a broken pipe elsewhere is something else)
            continue
        text = str(link)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            port = re.search(r"port: (\d+)", text)
            port = port.group(1) if port else os.environ.get("MASTER_PORT", "?")
            return ProcessGroupError(
                f"the port rank 0 listens on ({port}, MASTER_PORT) is in use (another run on this machine?): set "
                "MASTER_PORT to a free port, or (torchrun) pass another --master_port"
            )
        if isinstance(link, RuntimeError) and any(words in text.lower() for words in LOST_PEER):
            folder = os.environ.get("TANDEM_LIT_RUN_FOLDER")
            last = Path(folder) / "checkpoints" / "last.ckpt" if folder else None
            intact, resumable = describe_checkpoint(last) if last else ("", False)
            then = f"{intact}: resume with --ckpt_path {last}" if resumable else "no checkpoint was saved yet"
            return ProcessGroupError(
                f"another process of this run stopped, so this one (rank {launch_rank()}) cannot go on: its own "
                f"output says why (no line at all: it was killed, e.g. for lack of memory); {then}"
            )
    return None


def raised_by_torch_distributed(err: BaseException) -> bool:
    frame = err.__traceback__
    while frame is not None:
        if f"{os.sep}torch{os.sep}distributed{os.sep}" in frame.tb_frame.f_code.co_filename:
            return True
        frame = frame.tb_next
    return False


# settings that differ between ranks by design: rank 0 alone logs; the --config files may sit at
# other paths on other nodes (their contents are compared, as the settings they resolved to)
PER_RANK_SETTINGS = ("trainer.logger", "config")


def check_same_config(config: dict[str, Any]) -> None:
    """Every rank runs the config rank 0 runs (a config file edited on one node only would
    otherwise hang a collective or train something else on that rank): all stop with one line
    naming the first settings that differ."""
    def flat(value: Any, prefix: str = "") -> dict[str, str]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): repr(value)}

    mine = {k: v for k, v in flat(config).items() if not any(k == s or k.startswith(f"{s}.") for s in PER_RANK_SETTINGS)}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [(rank, key, every[0].get(key, "unset"), theirs.get(key, "unset")) for rank, theirs in enumerate(every)
              for key in sorted(set(every[0]) | set(theirs)) if every[0].get(key) != theirs.get(key)]
    if differ:
        shown = "; ".join(f"rank {rank} has {key}={value} where rank 0 has {first}" for rank, key, first, value in differ[:3])
        raise ConfigError(f"the ranks were started with different configs ({shown}{'; ...' if len(differ) > 3 else ''}): "
                          "give every node the same config files and options")


def shard_model(model: nn.Module, mesh, bf16_compute: bool) -> nn.Module:
    """``fully_shard`` each decoder layer (the model's ``_no_split_modules`` classes), then the
    root (embeddings, final norm, head). Float32 master shards; with ``bf16_compute`` layers are
    gathered and run in bf16 and gradients reduced in float32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_compute else MixedPrecisionPolicy()
    base = plain_model(model)
    layer_classes = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise TypeError(f"{type(base).__name__} names no decoder layer class (_no_split_modules): cannot shard it per layer")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # the training forward stops at the backbone (logprobs.py projects chunks itself): a forward
    # of the root unit all the same, so FSDP gathers its shards and reduces their gradients
    model.completion_hidden = functools.partial(last_hidden_state, model)
    register_fsdp_forward_method(model, "completion_hidden")
    return model


def check_several_processes(senior: nn.Module, trainer, mini_batch_size: int | None, prompts_per_step: int | None = None) -> None:
    """What must hold for W ranks to take equal shares of every step (``rank_rows``): of the data
    batch, or with dynamic sampling of its ``prompts_per_step`` kept groups (the data batch is then
    only the pool every rank draws from)."""
    world = trainer.world_size
    check_run_folder(trainer.default_root_dir)
    if not is_sharded(senior):
        raise ConfigError(
            f"{world} processes with trainer.strategy {type(trainer.strategy).__name__}: tandem-lit trains on "
            "several processes with trainer.strategy: fsdp (FSDP2) only"
        )
    if prompts_per_step is None:
        groups, what = getattr(trainer.datamodule, "batch_size", None), "data batch_size"
    else:
        groups, what = prompts_per_step, "rollout.dynamic_sampling.prompts_per_step"
    if groups is not None:
        try:
            rank_rows(groups, world, 0, mini_batch_size)
        except ValueError:
            raise ConfigError(
                f"{what} {groups} in mini-batches of {mini_batch_size or groups} prompts does not "
                f"split over {world} processes: make every mini-batch a multiple of {world} prompts"
            ) from None


def rank_rows(rows: int, world: int, rank: int, prompts_per_update: int | None) -> list[int]:
    """Indices of the global batch's rows that ``rank`` rolls out: its slice of every PPO
    mini-batch of ``prompts_per_update`` prompts (the whole batch: one update; the last one may be
    shorter), so that local update u is this rank's part of global update u."""
    per_update = min(prompts_per_update or rows, rows)
    picked = []
    for start in range(0, rows, per_update):
        size = min(per_update, rows - start)
        if size % world:
            raise ValueError(f"{rows} prompts per step in mini-batches of {per_update} do not split over {world} processes")
        share = size // world
        picked += range(start + rank * share, start + (rank + 1) * share)
    return picked


@dataclass(frozen=True)
class Shares:
    """Which prompt groups of a training step this rank rolls out and trains, and the collectives
    that keep W ranks deciding alike (``RolloutPhase.training_rollouts``). With one process
    (``world`` 1, the default) every method is the identity and no collective runs, so one process
    and W ranks share one code path.

    Every rank sees the whole data batch, so rows that fit ``max_prompt_tokens`` are the same on
    every rank. A step trains a multiple of W groups, each rank its ``rank_rows`` of them (its
    part of every PPO mini-batch): the last ``groups % W`` are left out (``balanced``), as DAPO
    trains a fixed number of prompts per step, because FSDP needs every rank to run the same
    updates, and unequal shares would leave a rank with nothing to run them on.
    """

    world: int = 1
    rank: int = 0
    prompts_per_update: int | None = None
    device: torch.device | str = "cpu"

    def balanced(self, groups: int) -> int:
        """How many of ``groups`` (in one-process order) a step trains: a multiple of W."""
        return groups - groups % self.world

    def of_step(self, groups: int) -> list[int]:
        """This rank's places among the ``groups`` a step trains (``balanced`` first)."""
        return rank_rows(groups, self.world, self.rank, self.prompts_per_update) if groups else []

    def updates(self, groups: int) -> int:
        """The optimiser updates a step makes that trains ``groups`` of this rank's groups: one per
        PPO mini-batch of ``prompts_per_update / W`` of them (as ``UpdatePhase`` cuts them), one
        when no mini-batch is set."""
        per_update = self.prompts_per_update // self.world if self.prompts_per_update else groups
        return -(-groups // max(per_update, 1)) if groups else 0

    def of_round(self, rows: int) -> list[int]:
        """This rank's rows of a dynamic-sampling round: contiguous, counts differing by one at most
        (a round refills what is missing, often fewer rows than ranks: some then roll out nothing)."""
        return list(range(self.rank * rows // self.world, (self.rank + 1) * rows // self.world))

    def total(self, values: list[float]) -> list[float]:
        """Elementwise sums over ranks of per-row values each rank fills in for its own rows."""
        return all_reduce_sum(values, self.device) if self.world > 1 and values else values

    def deal(self, kept: dict[int, Any], groups: int) -> list[Any]:
        """This rank's share of the ``groups`` a step trains, in ``of_step`` order. ``kept`` maps a
        place in one-process order to a kept group this rank rolled out (anything with ``.to``);
        the groups another rank trains go there, host copies in one ``all_gather_object``."""
        mine = self.of_step(groups)
        if self.world > 1:
            others = set(range(groups)) - set(mine)
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(everyone, {place: part.to("cpu") for place, part in kept.items() if place in others})
            kept = {**kept, **{place: part for sent in everyone for place, part in sent.items() if place in mine}}
        return [kept[place] for place in mine]


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def max_over_ranks(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Means over ranks; sums for counts, throughput and the loss (``SUMMED``); maxima for
    ``*_max`` and ``LARGEST``. A metric some ranks lack (e.g. a log-prob gap of a share with no
    senior token) is reduced over the ranks that have it. One small gather per step."""
    every: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, metrics)
    out = {}
    for name in sorted({n for part in every for n in part}):
        values = [part[name] for part in every if name in part]
        if name.endswith("_max") or name in LARGEST:
            out[name] = max(values)
        else:
            out[name] = sum(values) if name in SUMMED else sum(values) / len(values)
    return out




def balance(batches: list[Tensor], count: int) -> list[Tensor]:
    """Split the largest batches in two until there are ``count`` (FSDP needs every rank to run
    the same number of forward/backward passes; a gradient is a sum over rows, so splitting
    changes nothing else)."""
    batches = list(batches)
    while len(batches) < count:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) < 2:
            raise ValueError(f"cannot make {count} micro-batches of {sum(len(b) for b in batches)} rows")
        half = len(batches[largest]) // 2
        batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
    return batches


def full_value(tensor: Tensor) -> Tensor:
    """A DTensor's full value (a collective), any other tensor as is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
