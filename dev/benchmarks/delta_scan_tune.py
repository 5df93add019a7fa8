"""The delta rule's Triton scan (``models.delta_scan_kernels``) over its launch settings (issue 26).

At the 9B's linear-attention shape (32 heads, K = V = 128, 64-token chunks) the scan is most of the
rule's time (dev/log.md, 2026-12-03: 41.9 of 55 ms, forward + backward, 2 x 4,096
tokens) while its FLOPs would take ~1.5 ms at the card's float32 rate: each program walks the chunks
one after another, so it is bound by each step's latency, not by arithmetic. This times every
combination of the dots' precision (``ieee`` float32 on the CUDA cores, ``tf32x3``: three TF32
tensor-core products, float32 accuracy, ``tf32``: one, 10-bit mantissa), value columns per program
(more programs, or more work each) and warps per program, forward alone (the log-prob passes and
a checkpointed layer's first forward) and forward + backward, and prints each one's largest
relative error (output and every input's gradient) against the current setting.

    python dev/benchmarks/delta_scan_tune.py --tokens 4096 --rows 2
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from dev.benchmarks.delta_rule_cost import second_call_seconds  # noqa: E402


def scan_inputs(rows: int, tokens: int, heads: int = 32, dim: int = 128) -> list[torch.Tensor]:
    """The scan's inputs as the rule's first phase makes them from the layer's (random) q, k, v, g, beta."""
    from tandem_lit.models.delta_scan import chunk_terms, l2norm

    torch.manual_seed(0)
    q, k, v = (torch.randn(rows, heads, tokens, dim, device="cuda") for _ in range(3))
    q, k = l2norm(q) * dim**-0.5, l2norm(k)
    g, beta = -torch.rand(rows, heads, tokens, device="cuda") * 2, torch.rand(rows, heads, tokens, device="cuda")
    return [t.detach().contiguous().requires_grad_() for t in chunk_terms(q, k, v * 0.05, g, beta, 64)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--dots", nargs="+", default=["ieee", "tf32x3", "tf32"])
    parser.add_argument("--block-v", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    args = parser.parse_args()
    from tandem_lit.models import delta_scan_kernels as kernels

    terms = scan_inputs(args.rows, args.tokens)
    d_out = torch.randn_like(terms[2])

    def outputs(**settings) -> list[torch.Tensor]:
        out, _ = kernels.scan_triton(*terms, None, **settings)
        return [out.detach(), *torch.autograd.grad(out, terms, d_out)]

    current = dict(block_v=kernels.BLOCK_V, dot=kernels.DOT_PRECISION, num_warps=kernels.NUM_WARPS)
    want = outputs(**current)
    print(f"# scan of {args.rows} x {args.tokens} tokens, 32 heads, K = V = 128; current {current}")
    rows = []
    for dot, block_v, warps in itertools.product(args.dots, args.block_v, args.warps):
        settings = dict(block_v=block_v, dot=dot, num_warps=warps)
        try:
            with torch.no_grad():
                forward_ms = 1000 * second_call_seconds(lambda s=settings: kernels.scan_triton(*terms, None, **s), "cuda")
            both_ms = 1000 * second_call_seconds(lambda s=settings: outputs(**s), "cuda")
            got = outputs(**settings)
        except Exception as error:  # a setting the card cannot run (registers, shared memory): say so, go on
            print(f"dot={dot:7} block_v={block_v:3} warps={warps}: failed ({type(error).__name__}: {str(error)[:120]})")
            continue
        error = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
        rows.append((both_ms, dot, block_v, warps))
        print(f"dot={dot:7} block_v={block_v:3} warps={warps}: forward {forward_ms:6.2f} ms, forward + backward "
              f"{both_ms:6.2f} ms, max relative error {error:.1e}")
    accurate = [r for r in rows if r[1] != "tf32"]
    best = min(accurate)
    base = next(r for r in rows if (r[1], r[2], r[3]) == (current["dot"], current["block_v"], current["num_warps"]))
    print(f"best_float32_accurate dot={best[1]} block_v={best[2]} warps={best[3]} forward_backward_ms={best[0]:.2f} "
          f"current_ms={base[0]:.2f} best_over_current={best[0] / base[0]:.2f}")


if __name__ == "__main__":
    main()
