"""One RMSNorm's forward + backward, per call: transformers' composite, Liger's Triton kernel and
torch's fused ``F.rms_norm``, at a host-bound shape and at Qwen3-4B's shapes (issue 27).

Why: in the update's short passes (lognormal lengths) the host's launch time shows, and Liger's
norm spends ~0.4 ms a call in Python before its kernel runs. ``models.liger`` runs torch's op for
the norms whose input and weight share a dtype; this is the measurement behind that choice.
Each variant: 3 warm-up calls, then ``--calls`` timed back to back, one sync at the end.

    python dev/benchmarks/rms_norm_call.py --dtype float32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(8, 2560), (4096, 2560), (4096 * 32, 128)]  # host-bound; the residual stream; q/k norms (32 heads)


def composite(x, w, eps=1e-6):  # transformers' LlamaRMSNorm / Qwen3RMSNorm
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def liger(x, w, eps=1e-6):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False, None)


def fused(x, w, eps=1e-6):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def per_call_us(norm, shape, dtype, calls: int) -> float:
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.ones(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    for _ in range(3):
        norm(x, w).backward(grad)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        norm(x, w).backward(grad)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    x = torch.randn(64, 2560, device="cuda", dtype=dtype)
    w = torch.rand(2560, device="cuda", dtype=dtype) + 0.5
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}, {args.dtype}; "
          f"max |liger - composite| {(liger(x, w) - composite(x, w)).abs().max().item():.2e}, "
          f"max |fused - composite| {(fused(x, w) - composite(x, w)).abs().max().item():.2e}")
    for shape in SHAPES:
        times = {name: per_call_us(norm, shape, dtype, args.calls) for name, norm in
                 [("composite", composite), ("liger", liger), ("fused", fused)]}
        row = "  ".join(f"{name} {us:7.1f} us" for name, us in times.items())
        print(f"{str(list(shape)):>14}: {row}  fused_over_liger={times['fused'] / times['liger']:.2f}")


if __name__ == "__main__":
    main()
