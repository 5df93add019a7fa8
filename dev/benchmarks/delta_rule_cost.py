"""What running Qwen3.5's chunked delta rule in float32 costs the update (issue 26).

transformers' torch path of the chunked gated delta rule (``torch_chunk_gated_delta_rule``, what
the update runs without flash-linear-attention) casts its inputs to float32, but under bf16
autocast each of its matmuls rounds to bf16 again. ``rollout.logprobs.float32_delta_rule`` runs it
with autocast off, as FastEngine runs its recurrence; on CUDA it runs ``models.delta_scan``'s rule
instead, the chunk loop as two Triton kernels (``triton``). This times one call's forward +
backward at the 9B's linear-attention shape (32 value heads of 128, the key heads repeated to them), each way, counts
the bytes autograd saves, and prints how far the Triton rule's output is from the float32 one.
``inverse`` is the same rule with the first phase's chunk systems solved through their inverses
(``models.delta_scan.SOLVES``); the last line splits the rule into its first phase (each solve)
and its scan, forward + backward each.

    python dev/benchmarks/delta_rule_cost.py --device cuda --tokens 4096 --rows 2
    python dev/benchmarks/delta_rule_cost.py --device cpu --tokens 1024 --rows 1
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def second_call_seconds(call, device: str) -> float:
    """Seconds of the second of two calls of ``call()`` (the first compiles and warms up)."""
    for _ in range(2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds


def run(rule, inputs: list[torch.Tensor], device: str) -> tuple[float, int]:
    """Seconds of forward + backward (the second of two calls) and bytes autograd saved."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    def call() -> None:
        saved.clear()
        with torch.autocast(device, dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            q, k, v, g, beta = inputs
            out, _ = rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        out.float().square().mean().backward()

    return second_call_seconds(call, device), sum(saved.values())


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
    # ours: what float32_delta_rule runs on CUDA (the scan in Triton); on the CPU the same rule with its torch scan
    ours = "triton" if args.device == "cuda" else "ours"
    rules[ours] = without_autocast(chunk_gated_delta_rule)
    # the first phase's chunk solves the other way (models.delta_scan.SOLVES): through each
    # chunk's inverse, one solve against the identity (on the CPU: the torch scan)
    rules["inverse"] = without_autocast(functools.partial(chunk_gated_delta_rule, solve="inverse"))
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
    same_scan = ours  # the rule `inverse` differs from in its solves only
    i, i_bytes = results["inverse"]
    base, base_bytes = results[same_scan]
    with torch.no_grad():
        want, got = (rules[name](*inputs[:3], g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True)[0].float()
                     for name in (same_scan, "inverse"))
    print(f"inverse_over_{same_scan} time={i / base:.2f} saved_bytes={i_bytes / base_bytes:.2f} "
          f"output_relative_error={((got - want).norm() / want.norm()).item():.2e}")
    print(phase_split(inputs, args.device))


def phase_split(inputs: list[torch.Tensor], device: str) -> str:
    """Forward + backward of the first phase alone (each solve) and of the scan alone (Triton on
    CUDA, the torch loop elsewhere), at the same shape: where the rule's time goes."""
    from tandem_lit.models import delta_scan

    q, k, v, g, beta = (x.detach() for x in inputs)
    heads = v.shape[2]
    q, k = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous().requires_grad_() for x in (q, k, v, g, beta))
    pad = -q.shape[2] % 64
    padded = [torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v)] + [torch.nn.functional.pad(x, (0, pad)) for x in (g, beta)]
    timings = {}
    for solve in delta_scan.SOLVES:
        timings[f"first_phase_{solve}"] = timed(lambda solve=solve: delta_scan.chunk_terms(*padded, 64, solve), device)
    terms = [t.detach().requires_grad_() for t in delta_scan.chunk_terms(*padded, 64)]
    if device == "cuda":
        from tandem_lit.models.delta_scan_kernels import scan_triton

        timings["scan_triton"] = timed(lambda: scan_triton(*terms, None), device)
    else:
        timings["scan_torch"] = timed(lambda: delta_scan.scan_reference(*terms, None), device)
    return " ".join(f"{name}_ms={ms:.1f}" for name, ms in timings.items())


def timed(forward, device: str) -> float:
    """Milliseconds of ``forward()`` and a backward through all it returns (the second of two calls)."""

    def call() -> None:
        outputs = [t for t in forward() if t.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])

    return 1000 * second_call_seconds(call, device)


def without_autocast(rule):
    """``rule`` with autocast off, as ``rollout.logprobs.float32_delta_rule`` runs it."""

    def run(query, *args, **kwargs):
        with torch.autocast(query.device.type, enabled=False):
            return rule(query, *args, **kwargs)

    return run


if __name__ == "__main__":
    main()
