"""Liger-Kernel in the update, kernel by kernel: one update pass of the paper config's senior.

    python dev/benchmarks/update_kernels.py                          # Qwen3-4B, 128 + 3,000 tokens per pass
    python dev/benchmarks/update_kernels.py --model qwen35-9b --completion 2048
    python dev/benchmarks/update_kernels.py --device cpu --tiny      # CPU check of this script (PyTorch only)
    python dev/benchmarks/update_kernels.py --completions 1100 1050 1000 --variants off liger  # a filled pass of unequal rows

A pass is what ``UpdatePhase`` runs per micro-batch of ``configs/rlvr/qwen3_4b_tandem.yaml``
(``micro_batch_tokens: 4096``: one sequence of a 128-token prompt and 3,000 completion tokens):
the teacher-forced completion log-probs (``rollout.logprobs.completion_logprobs``), temperature
0.6, under bf16 autocast over float32 weights without a cast cache (Lightning's ``bf16-mixed``),
then the backward of a weighted sum of them into float32 gradients that accumulate as in a
mini-batch. Random weights (the FLOPs and the kernels do not depend on them).

Variants, each in the same run on the same model: PyTorch (``off``), each Liger kernel alone
(``rms_norm``, ``swiglu``, ``rope``, ``logprobs``: the fused head), and all that fit the
architecture (``liger``); a variant with ``+once`` (``liger+once``) runs its passes with the linear
weights cast to bf16 once (``memory.cast_weights_once``: ``training.compute_weights``, its cast made
once for all the variant's passes, as an update makes it once for its ~64) instead of by autocast
in every forward. Per variant: ms per trained pass and per forward-only pass (the old
log-probs of the second PPO mini-batch), the trained pass's model FLOPs as MFU (``train_step.py``'s
count), peak memory, the log-prob difference from ``off`` (mean / max over tokens), and the
config's update estimated from them: 128 trained + 64 forward-only passes (16 prompts x 8
rollouts, two mini-batches), without the optimizer steps. Then the CUDA kernels of one trained
pass, ``off`` and ``liger``, by time (torch.profiler).
Last line: ``liger_over_off_update=<ratio> off_update_s=<s> liger_update_s=<s>``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # rollout.py, train_step.py
from rollout import QWEN3_4B, QWEN35_9B, TINY_SENIOR, build_qwen3, build_qwen35  # noqa: E402
from train_step import flop_shape, update_flops  # noqa: E402

from tandem_lit.models import liger  # noqa: E402
from tandem_lit.rollout.logprobs import completion_logprobs  # noqa: E402
from tandem_lit.rollout.record import Author, Rollout  # noqa: E402
from tandem_lit.training.compute_weights import ComputeWeights  # noqa: E402

MODELS = {"qwen3-4b": (build_qwen3, QWEN3_4B, 151936), "qwen35-9b": (build_qwen35, QWEN35_9B, 248320)}
TRAINED, FORWARD_ONLY = 128, 64  # passes of one step of the paper config


def synthetic_rollout(vocab: int, prompt: int, completions: list[int], device: str) -> Rollout:
    """Rows of ``prompt`` tokens and these completion lengths, right-padded to the longest (as
    ``UpdatePhase``'s filled passes pad unequal rows: the attention then gets a padding mask)."""
    generator = torch.Generator().manual_seed(0)
    rows, completion = len(completions), max(completions)
    prompt_ids = torch.randint(4, vocab, (rows, prompt), generator=generator)
    completion_ids = torch.randint(4, vocab, (rows, completion), generator=generator)
    author = torch.full((rows, completion), int(Author.SENIOR), dtype=torch.int8)
    for row, length in enumerate(completions):
        author[row, length:] = int(Author.PAD)
    tensors = (prompt_ids, torch.ones_like(prompt_ids), completion_ids, author, torch.ones(rows, dtype=torch.bool),
               torch.zeros(rows, dtype=torch.bool), *(torch.zeros(rows, dtype=torch.long),) * 3)
    return Rollout(*(t.to(device) for t in tensors), texts=[""] * rows)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Pass:
    """One update pass of ``model`` over ``rollout`` under the update's precision."""

    def __init__(self, model: nn.Module, rollout: Rollout, device: str, autocast: bool, temperature: float = 0.6):
        self.model, self.rollout, self.device, self.autocast, self.temperature = model, rollout, device, autocast, temperature
        written = rollout.completion_mask
        self.weights = torch.linspace(-1, 1, written.numel(), device=device).view_as(written) * written

    def logprobs(self, fused: bool):
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast, cache_enabled=False):
            return completion_logprobs(self.model, self.rollout, self.temperature, fused=fused)

    def trained(self, fused: bool) -> None:
        (self.logprobs(fused) * self.weights).sum().backward()

    def forward_only(self, fused: bool) -> torch.Tensor:
        with torch.no_grad():
            return self.logprobs(fused)

    def seconds(self, run, repeats: int) -> float:
        sync(self.device)
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        sync(self.device)
        return (time.perf_counter() - started) / repeats


def profile_rows(run, device: str, rows: int) -> list[str]:
    """The CUDA kernels of one ``run()`` by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync(device)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    lines = [f"  {total / 1000:8.1f} ms of kernels"]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:rows]:
        lines.append(f"  {e.device_time_total / total:6.1%} {e.device_time_total / 1000:8.2f} ms {e.count:6d}x  {e.key[:100]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-4b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3 shapes (a CPU check of this script)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--completion", type=int, default=3000)
    parser.add_argument("--rows", type=int, default=1, help="sequences per pass (the config's micro_batch_tokens allow one)")
    parser.add_argument("--completions", type=int, nargs="+", default=None,
                        help="one pass of rows of these completion lengths, padded to the longest (instead of --rows x --completion)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=None, help="off, liger, or kernel names (default: all)")
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--profile-rows", type=int, default=20, help="kernels listed per profiled variant (0: no profile)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    build, shape, vocab = MODELS[args.model]
    if args.tiny:
        shape, vocab, args.prompt, args.completion, args.repeats = TINY_SENIOR, 256, 8, 24, 2
    model = build(shape, vocab, torch.float32, args.device, seed=0).train().requires_grad_(True)
    kinds = liger.ARCHITECTURES[model.config.model_type].kernels
    variants = args.variants or (["off", *kinds, "liger"] if args.device == "cuda" else ["off"])
    completions = args.completions or [args.completion] * args.rows
    if args.tiny and args.completions:
        completions = [max(1, round(c * args.completion / max(completions))) for c in completions]
    rollout = synthetic_rollout(vocab, args.prompt, completions, args.device)
    step = Pass(model, rollout, args.device, autocast=args.device == "cuda")
    lengths = dict(prompts=[args.prompt] * len(completions), completions=completions)
    tokens = sum(completions) + args.prompt * len(completions)  # written tokens of a pass (padding excluded)
    trained_flops = update_flops(**flop_shape(model), **lengths, forward_only_rows=[])
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    shape_text = (f"{len(completions)} x ({args.prompt} + {completions[0]})" if len(set(completions)) == 1
                  else f"{args.prompt} + ({', '.join(map(str, completions))}) padded to {max(completions)}")
    print(f"# {args.model}{' (tiny)' if args.tiny else ''} on {name}: {shape_text} "
          f"tokens per pass, float32 weights{', bf16 autocast' if step.autocast else ''}; liger-kernel "
          f"{liger.liger_version() if liger.liger_missing() is None else 'not importable'}", flush=True)

    results, reference, profiles = {}, None, {}
    for variant in variants:
        base, once = variant.removesuffix("+once"), variant.endswith("+once")
        kernels = kinds if base == "liger" else () if base == "off" else (base,)
        liger.apply_liger(model, kernels)
        fused = "logprobs" in kernels
        cast_once = ComputeWeights(model, torch.bfloat16 if once and step.autocast else None).__enter__()
        step.trained(fused)  # warm-up: Triton compilation, cuBLAS plans, the gradient buffers
        step.trained(fused)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trained = step.seconds(lambda fused=fused: step.trained(fused), args.repeats)
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
        # warm-up of the no-grad path too (its own kernels and cuBLAS plans: unwarmed, the first
        # variant's forward-only pass once took 554 ms against ~85 for the others on an H200)
        step.forward_only(fused)
        forward = step.seconds(lambda fused=fused: step.forward_only(fused), args.repeats)
        logp = step.forward_only(fused).float()
        reference = logp if reference is None else reference
        gap = (logp - reference).abs()
        results[variant] = row = {
            "kernels": list(kernels), "trained_ms": 1000 * trained, "forward_ms": 1000 * forward, "peak_gb": peak,
            "mfu": trained_flops / (trained * args.peak_tflops * 1e12), "update_s": TRAINED * trained + FORWARD_ONLY * forward,
            "logp_gap_mean": float(gap.mean()), "logp_gap_max": float(gap.max()),
            "trained_ms_per_1k_tokens": 1e6 * trained / tokens,
        }
        print(f"{variant:>9}: trained pass {row['trained_ms']:8.1f} ms ({row['trained_ms_per_1k_tokens']:.1f} ms per 1k tokens, {row['mfu']:.1%} MFU of {args.peak_tflops:g} TFLOP/s), "
              f"forward-only {row['forward_ms']:7.1f} ms, peak {peak:6.1f} GiB; config update ~{row['update_s']:6.1f} s "
              f"({TRAINED} + {FORWARD_ONLY} passes); |logp - {variants[0]}| mean {row['logp_gap_mean']:.2e} max {row['logp_gap_max']:.2e}",
              flush=True)
        if args.device == "cuda" and args.profile_rows and variant in ("off", "liger", "liger+once"):
            profiles[variant] = profile_rows(lambda fused=fused: step.trained(fused), args.device, args.profile_rows)
        cast_once.__exit__(None, None, None)
        model.zero_grad(set_to_none=True)
        liger.remove_liger(model)
    for variant, lines in profiles.items():
        print(f"\n== CUDA kernels of one trained pass, {variant}:")
        print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "device": name, "args": vars(args), "variants": results}, indent=2))
    if "off" in results and "liger" in results:
        off, fused = results["off"]["update_s"], results["liger"]["update_s"]
        passes = results["liger"]["trained_ms"] / results["off"]["trained_ms"]
        print(f"liger_over_off_update={fused / off:.3f} liger_over_off_trained_pass={passes:.3f} "
              f"off_update_s={off:.1f} liger_update_s={fused:.1f}")
    elif "off" in results:
        print(f"off_update_s={results['off']['update_s']:.1f}")
    for base in ("off", "liger"):
        if base in results and f"{base}+once" in results:
            ratio = results[f"{base}+once"]["update_s"] / results[base]["update_s"]
            print(f"{base}_cast_once_over_per_forward_update={ratio:.3f} {base}+once_update_s={results[f'{base}+once']['update_s']:.1f}")


if __name__ == "__main__":
    main()
