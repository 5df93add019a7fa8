"""The Triton decode kernels against the plain-torch decode path, in Triton's CPU interpreter.

The GPU runs them compiled (tests/test_fast_engine.py compares whole rollouts there); here the
interpreter checks the arithmetic on any machine. The attention kernel's loop bound is read on the
device, which the interpreter cannot run; the GPU tests cover it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="the Triton kernels need the triton package (dev extra, Linux)")

CHECK = textwrap.dedent("""
    import torch
    from tandem_lit.rollout import kernels
    from tandem_lit.rollout.fast import _rms_norm, _rotate_half

    torch.manual_seed(0)
    B, H, KV, D, S, hidden = 3, 8, 2, 16, 20, 32
    for has_norm in (True, False):
        qkv = torch.randn(B, (H + 2 * KV) * D)
        q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)  # strided views, as from the fused projection
        qn, kn = torch.randn(D), torch.randn(D)
        cos, sin = torch.randn(S, D), torch.randn(S, D)
        pos, slot = torch.tensor([3, 7, 11]), torch.tensor([5])
        kc, vc = torch.zeros(B, KV, S, D), torch.zeros(B, KV, S, D)
        out = kernels.qk_rope_cache(q, k, v, qn if has_norm else None, kn if has_norm else None, 1e-6,
                                    cos, sin, pos, slot, kc, vc, H, KV, D)
        qh, kh = q.reshape(B, H, D), k.reshape(B, KV, D)
        if has_norm:
            qh, kh = _rms_norm(qh, qn, 1e-6), _rms_norm(kh, kn, 1e-6)
        c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        torch.testing.assert_close(out, (qh * c + _rotate_half(qh) * s).reshape(B, -1))
        torch.testing.assert_close(kc[:, :, 5], kh * c + _rotate_half(kh) * s)
        torch.testing.assert_close(vc[:, :, 5], v.reshape(B, KV, D))
        assert kc[:, :, :5].abs().max() == 0 and vc[:, :, 6:].abs().max() == 0  # only the slot is written

    x, delta, w = torch.randn(4, hidden), torch.randn(4, hidden), torch.randn(hidden)
    stream = x.clone()
    normed = kernels.add_rms_norm(stream, delta, w, 1e-5)
    torch.testing.assert_close(stream, x + delta)  # the residual stream is updated in place
    torch.testing.assert_close(normed, _rms_norm(x + delta, w, 1e-5))
    torch.testing.assert_close(kernels.add_rms_norm(x.clone(), None, w, 1e-5), _rms_norm(x, w, 1e-5))

    gate_up = torch.randn(4, 128)
    gate, up = gate_up.split([64, 64], dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    print("kernels ok")
""")


def test_kernels_match_the_torch_decode_path():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernels are defined: a fresh process
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernels ok" in done.stdout
