"""Save and load time of a full-weight checkpoint with AdamW state, both ways, on W CPU processes
(gloo): one file of full tensors gathered to rank 0 (the default) vs a folder in which every rank
writes its own shards (``checkpoint.sharded``). A Qwen3-4B layer shape with fewer layers, so that
it fits a small machine; the 4B numbers are extrapolated by bytes (the work is a copy per byte).

    python -m dev.benchmarks.checkpoint_io --layers 2 --world 2 --out /tmp/ckpt_bench
    python -m dev.benchmarks.checkpoint_io --device cuda --layers 36 --out /tmp/ckpt_bench   # the 4B, one GPU process

On a GPU (one process, NCCL) the model and its AdamW state live on the card, as in training; the
sharded checkpoint is deleted before the one file is written, so that the disk holds one 4B
checkpoint (48 GB) at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, tie_word_embeddings=True)
QWEN3_4B_PARAMETERS = 4.02e9


def worker(rank: int, world: int, port: int, layers: int, out: str, device: str, results) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tandem_lit.training.callbacks import AtomicCheckpointIO
    from tandem_lit.training.distributed import shard_model
    from tandem_lit.training.sharded import load_sharded_into, remove_sharded, save_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, **QWEN3_4B))
    model = shard_model(model, init_device_mesh(device, (world,)), bf16_compute=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    get_optimizer_state_dict(model, optimizer)  # (creates AdamW's state)
    parameters = sum(p.numel() for p in model.parameters())
    folder = Path(out)
    timings: dict[str, float] = {}

    def timed(name, fn):
        dist.barrier()
        start = time.perf_counter()
        value = fn()
        dist.barrier()
        timings[name] = time.perf_counter() - start
        if rank == 0:  # as measured: a run cut short keeps what it had
            print(f"{name}={timings[name]:.1f}", flush=True)
        return value

    def broadcast(value):
        box = [value]
        dist.broadcast_object_list(box)
        return box[0]

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def save_full():  # what FSDP2Strategy does by default: gather to rank 0, one atomic file
        checkpoint = {"state_dict": get_model_state_dict(model, options=full),
                      "optimizer_states": [get_optimizer_state_dict(model, optimizer, options=full)]}
        if rank == 0:
            AtomicCheckpointIO().save_checkpoint(checkpoint, folder / "full.ckpt")

    def load_full():
        checkpoint = torch.load(folder / "full.ckpt", map_location="cpu", mmap=True, weights_only=False)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_model_state_dict(model, checkpoint["state_dict"], options=options)
        set_optimizer_state_dict(model, optimizer, checkpoint["optimizer_states"][0], options=options)

    def save_shards():
        checkpoint = {"global_step": 1, "state_dict": get_model_state_dict(model),
                      "optimizer_states": [get_optimizer_state_dict(model, optimizer)]}
        save_sharded(checkpoint, folder / "sharded.ckpt", rank, broadcast, dist.barrier)

    def size(path: Path) -> float:
        return sum(f.stat().st_size for f in path.resolve().rglob("*") if f.is_file()) / 1e9

    # one 4B checkpoint on the disk at a time (a 64 GiB disk holds one, not two): the shards first,
    # then the one file (last, since its memory-mapped load may keep the file's pages alive)
    timed("save_sharded_s", save_shards)
    timed("load_sharded_s", lambda: load_sharded_into(folder / "sharded.ckpt", model, [optimizer]))
    sharded_gb = size(folder / "sharded.ckpt") if rank == 0 else 0.0
    dist.barrier()
    if rank == 0:
        remove_sharded(folder / "sharded.ckpt")
    timed("save_one_file_s", save_full)
    timed("load_one_file_s", load_full)
    if rank == 0:
        results.update(timings, parameters=parameters, one_file_gb=(folder / "full.ckpt").stat().st_size / 1e9,
                       sharded_gb=sharded_gb)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default="/tmp/tandem_lit_checkpoint_bench")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one process, NCCL")
    args = parser.parse_args()
    if args.device == "cuda":
        args.world = 1
    shutil.rmtree(args.out, ignore_errors=True)
    Path(args.out).mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args.world, port, args.layers, args.out, args.device, results), nprocs=args.world)
        results = dict(results)
    scale = QWEN3_4B_PARAMETERS / results["parameters"]
    results["extrapolated_to_4b"] = {k: round(v * scale, 1) for k, v in results.items() if k.endswith("_s")}
    print(json.dumps({"device": args.device, "world": args.world, "layers": args.layers, **results}, indent=2))
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
