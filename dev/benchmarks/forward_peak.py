"""Peak memory of one decoder layer's forward pass without autograd (the update's log-prob passes),
per token, against what the memory plan counts for it
(``ModelShape.largest_layer_bytes_per_token``), on the CPU.

    python dev/benchmarks/forward_peak.py --models qwen35-9b qwen3-4b --rows 2 --tokens 2048

Each layer type (Qwen3.5: Gated DeltaNet and gated full attention) runs in a process of its own at
the real width, bf16 weights under bf16 autocast with Qwen3.5's delta rule in float32 (as the
update runs it); the peak is the process's resident set's high-water mark over the pass (Linux:
reset through /proc/self/clear_refs) less what it held before (weights, inputs), with glibc's mmap
threshold pinned so freed tensors leave the resident set at once. Issue 53: the Qwen3.5 LoRA
config's first update on an H100 ran out of memory well above its plan, whose largest part was a
log-prob pass of 32,192 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activation_bytes import MODELS, config_of  # noqa: E402  (the real-shape configs, one source)


def status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (the most since the last reset) of this process, in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak() -> int:
    """Reset the resident set's high-water mark (Linux: clear_refs 5); returns what is resident now."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def one_layer(name: str, kind: str, rows: int, tokens: int) -> dict:
    """In this process: the peak of one ``kind`` layer's no-grad forward over [rows, tokens]."""
    from tandem_lit.rollout.logprobs import float32_delta_rule

    float32_delta_rule()
    config = config_of(name)
    types = list(getattr(config, "layer_types", None) or ["full_attention"])
    module = __import__(type(config).__module__.replace("configuration_", "modeling_"), fromlist=["_"])
    layer_class = next(getattr(module, n) for n in dir(module) if n.endswith("DecoderLayer"))
    rotary_class = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    layer = layer_class(config, types.index(kind)).to(torch.bfloat16).eval()
    rotary = rotary_class(config)

    def run(width: int):
        hidden = torch.randn(rows, width, config.hidden_size, dtype=torch.bfloat16)
        positions = torch.arange(width)[None].expand(rows, -1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            cos_sin = rotary(hidden, positions)
            before = reset_peak()
            out = layer(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
        return before, out.numel() * out.element_size()

    run(64)  # first calls' one-time allocations
    hidden_bytes = rows * tokens * config.hidden_size * 2
    before, out_bytes = run(tokens)
    peak = status_bytes("VmHWM") - before
    return {"model": name, "kind": kind, "rows": rows, "tokens": tokens, "peak_bytes_per_token": peak / (rows * tokens),
            "input_and_output_bytes_per_token": (hidden_bytes + out_bytes) / (rows * tokens)}


def plan(name: str) -> dict:
    """What the memory plan counts per token for a forward-only pass (its largest layer), and per type."""
    from transformers import AutoModelForCausalLM

    from tandem_lit.training.memory import ModelShape

    config = config_of(name)
    with torch.device("meta"):
        shape = ModelShape.of(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
    llama = shape.layer_bytes_per_token(2)
    types = list(getattr(config, "layer_types", None) or ["full_attention"])
    return {kind: factor * llama for kind, factor in zip(types, shape.layer_factors or (1.0,) * len(types))} | {
        "largest": shape.largest_layer_bytes_per_token(2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen35-9b", "qwen3-4b"], choices=sorted(MODELS))
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per row")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "KIND"), help=argparse.SUPPRESS)  # (the child process)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_layer(*args.one, args.rows, args.tokens)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    for name in args.models:
        counted = plan(name)
        for kind in (k for k in counted if k != "largest"):
            child = subprocess.run([sys.executable, __file__, "--one", name, kind, "--rows", str(args.rows), "--tokens",
                                    str(args.tokens)], capture_output=True, text=True, env=env, check=True)
            measured = json.loads(child.stdout.strip().splitlines()[-1])
            per_token = measured["peak_bytes_per_token"]
            print(f"{name} {kind:<17} [{args.rows} x {args.tokens}] peak {per_token / 1024:7.1f} KiB/token "
                  f"(input and output {measured['input_and_output_bytes_per_token'] / 1024:.1f}); the plan counts "
                  f"{counted[kind] / 1024:7.1f} ({per_token / counted[kind]:.2f}x), its largest layer {counted['largest'] / 1024:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
