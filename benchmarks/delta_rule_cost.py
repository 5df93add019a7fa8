"""What running Qwen3.5's chunked delta rule in float32 costs the update (issue 26).

transformers' torch path of the chunked gated delta rule (``torch_chunk_gated_delta_rule``, what
the update runs without flash-linear-attention) casts its inputs to float32, but under bf16
autocast each of its matmuls rounds to bf16 again. ``rollout.logprobs.float32_delta_rule`` runs it
with autocast off, as FastEngine runs its recurrence; on CUDA it runs ``models.delta_scan``'s rule
instead, the chunk loop as two Triton kernels (``triton``). This times one call's forward +
backward at the 9B's linear-attention shape (32 value heads of 128, the key heads repeated to them), each way, counts
the bytes autograd saves, and prints how far the Triton rule's output is from the float32 one.

    python benchmarks/delta_rule_cost.py --device cuda --tokens 4096 --rows 2
    python benchmarks/delta_rule_cost.py --device cpu --tokens 1024 --rows 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(rule, inputs: list[torch.Tensor], device: str) -> tuple[float, int]:
    """Seconds of forward + backward (the second of two calls) and bytes autograd saved."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    seconds = 0.0
    for _ in range(2):
        saved.clear()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            q, k, v, g, beta = inputs
            out, _ = rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        out.float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds, sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35

    from tandem_lit.models.delta_scan import chunk_gated_delta_rule

    torch.manual_seed(0)
    shape = (args.rows, args.tokens)
    # as the layer hands them over: q, k, v from the bf16 convolution, g in float32, beta bf16; the 16
    # key heads already repeated to the 32 value heads (transformers 5.17's layer repeats them before
    # the rule, whose torch path needs equal heads; later versions repeat inside and take either)
    inputs = [torch.randn(*shape, 32, 128, dtype=torch.bfloat16), torch.randn(*shape, 32, 128, dtype=torch.bfloat16),
              torch.randn(*shape, 32, 128, dtype=torch.bfloat16) * 0.05, -torch.rand(*shape, 32) * 2,
              torch.rand(*shape, 32, dtype=torch.bfloat16)]
    inputs = [x.to(args.device).requires_grad_() for x in inputs]
    autocast_rule = qwen35.torch_chunk_gated_delta_rule  # transformers' (unwrapped if float32_delta_rule ran)
    autocast_rule = getattr(autocast_rule, "__wrapped__", autocast_rule) if getattr(autocast_rule, "autocast_off", False) else autocast_rule
    rules = {"autocast": autocast_rule, "float32": without_autocast(autocast_rule)}
    if args.device == "cuda":
        rules["triton"] = without_autocast(chunk_gated_delta_rule)  # what float32_delta_rule runs on CUDA
    results = {name: run(rule, inputs, args.device) for name, rule in rules.items()}
    tokens = args.rows * args.tokens
    for name, (seconds, nbytes) in results.items():
        print(f"{name:>8}: forward + backward {seconds * 1000:8.1f} ms, saved {nbytes / tokens / 1024:6.1f} KiB/token")
    (a, a_bytes), (f, f_bytes) = results["autocast"], results["float32"]
    print(f"float32_over_autocast time={f / a:.2f} saved_bytes={f_bytes / a_bytes:.2f} ({args.rows} x {args.tokens} tokens, "
          f"{args.device}; one linear-attention layer; the 9B has 24)")
    if "triton" in results:
        t, t_bytes = results["triton"]
        with torch.no_grad():
            want, got = (rules[name](*inputs[:3], g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True)[0].float()
                         for name in ("float32", "triton"))
        print(f"triton_over_float32 time={t / f:.2f} saved_bytes={t_bytes / f_bytes:.2f} "
              f"output_relative_error={((got - want).norm() / want.norm()).item():.2e}")


def without_autocast(rule):
    """``rule`` with autocast off, as ``rollout.logprobs.float32_delta_rule`` runs it."""

    def run(query, *args, **kwargs):
        with torch.autocast(query.device.type, enabled=False):
            return rule(query, *args, **kwargs)

    return run


if __name__ == "__main__":
    main()
