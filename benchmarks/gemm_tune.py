"""Decode-step projections: cuBLAS (F.linear) vs the skinny Triton GEMM, per shape and batch.

    python benchmarks/gemm_tune.py --batches 64 16 256

Every projection of the Qwen3-4B / Qwen3-1.7B decode step at M = batch rows, bf16. Each timed call
runs the product over several copies of the weight (more bytes than the 60 MB L2), inside a CUDA
graph, as in the decode step where each weight is read once per step; time per product is the
median over replays divided by the copies. Split-K configurations include zeroing their float32
output. Prints, per shape, cuBLAS and the best Triton configurations with achieved bandwidth, and
the per-step total at each batch.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F
import triton.testing

from tandem_lit.rollout.kernels import skinny_linear

# (name, N, K, per-step count) for the senior (36 layers) and junior (28 layers)
SHAPES = [
    ("4B qkv", 6144, 2560, 36), ("4B o", 2560, 4096, 36), ("4B gate_up", 19456, 2560, 36),
    ("4B down", 2560, 9728, 36), ("4B lm_head", 151936, 2560, 1),
    ("1.7B qkv", 4096, 2048, 28), ("1.7B o", 2048, 2048, 28), ("1.7B gate_up", 12288, 2048, 28),
    ("1.7B down", 2048, 6144, 28), ("1.7B lm_head", 151936, 2048, 1),
]


def timed(fn, copies: int) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") / copies


def bench_shape(name: str, n: int, k: int, m: int, candidates: list) -> tuple[float, list]:
    """cuBLAS time and the sorted (time, config) of the Triton candidates for one [m, k] x [n, k]^T."""
    copies = max(2, math.ceil(400e6 / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.double(), weights[0].double())
    outs32 = [torch.zeros(m, n, device="cuda", dtype=torch.float32) for _ in range(copies)]

    def cublas():
        for w in weights:
            F.linear(x, w)

    results = []
    for bn, bk, split, warps, stages in candidates:
        if split > 1 and k % (bk * split):
            continue

        def run(bn=bn, bk=bk, split=split, warps=warps, stages=stages):
            for w, o in zip(weights, outs32):
                if split > 1:
                    o.zero_()
                skinny_linear(x, w, None, bn, bk, split, warps, stages, out=o if split > 1 else None)

        try:
            out = skinny_linear(x, weights[0], None, bn, bk, split, warps, stages,
                                out=outs32[0].zero_() if split > 1 else None)
            err = float((out.double() - ref).norm() / ref.norm())
            if not err < 1e-2:
                print(f"  WRONG {name} {bn}/{bk}/{split}/{warps}/{stages}: rel err {err:.2e}")
                continue
            results.append((timed(run, copies), (bn, bk, split, warps, stages)))
        except Exception as exc:  # out of resources for this tile shape
            print(f"  skip {name} {bn}/{bk}/{split}/{warps}/{stages}: {type(exc).__name__}")
    return timed(cublas, copies), sorted(results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 16, 256])
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    configs = list(itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (4,), (3, 5)))
    best_by_shape: dict[str, list] = {}
    totals = {}
    for m in args.batches:
        total_cublas = total_triton = 0.0
        print(f"\n== M={m}", flush=True)
        for name, n, k, count in SHAPES:
            candidates = configs if m == args.batches[0] else best_by_shape[name]
            t_cublas, results = bench_shape(name, n, k, m, candidates)
            if m == args.batches[0]:
                best_by_shape[name] = [cfg for _, cfg in results[: args.top]]
            t_best, cfg = results[0]
            moved = n * k * 2 + 2 * m * (k + n)
            total_cublas += count * t_cublas
            total_triton += count * min(t_best, t_cublas)
            print(f"{name:<13} N={n:>6} K={k:>5} cuBLAS {t_cublas * 1000:7.1f} us {moved / t_cublas / 1e9:6.0f} GB/s | "
                  f"triton {t_best * 1000:7.1f} us {moved / t_best / 1e9:6.0f} GB/s {cfg} x{t_cublas / t_best:.2f} | "
                  + "; ".join(f"{c} {t * 1000:.1f}" for t, c in results[1: args.top]), flush=True)
        totals[m] = (total_cublas, total_triton)
        print(f"M={m}: projections per tandem step: cuBLAS {total_cublas:.3f} ms, best of both {total_triton:.3f} ms")
    for m, (a, b) in totals.items():
        print(f"summary M={m}: cuBLAS {a:.3f} ms/step, with Triton where faster {b:.3f} ms/step ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
