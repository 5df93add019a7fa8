"""The Triton decode kernels against the plain-torch decode path, in Triton's CPU interpreter
(the attention kernels over slot caches and over paged pools read through a block table).

The GPU runs them compiled (tests/test_fast_engine.py compares whole rollouts there); here the
interpreter checks the arithmetic on any machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("triton", reason="the Triton kernels need the triton package (dev extra, Linux)")

CHECK = textwrap.dedent("""
    import torch

    import tests.triton_interpreter  # noqa: F401 (loop bounds read on the device, Triton < 3.9)
    from tandem_lit.rollout.static import kernels
    from tandem_lit.rollout.static.blocks import rms_norm as _rms_norm, rotate_half as _rotate_half

    def paged(k_cache, v_cache, page):  # [B, KV, S, D] caches as shuffled pages of random pools + table
        batch, kv, length, d = k_cache.shape
        cols = length // page
        table = (torch.randperm(3 * batch * cols)[: batch * cols] + 1).view(batch, cols).to(torch.int32)
        pools = []
        for cache in (k_cache, v_cache):
            pool = torch.randn(3 * batch * cols + 1, kv, page, d)  # [pages, KV, page, D]
            pool[table.long()] = cache.view(batch, kv, cols, page, d).transpose(1, 2)
            pools.append(pool)
        return pools, table

    def unpage(pool, table):
        batch, cols = table.shape
        return pool[table.long()].transpose(1, 2).reshape(batch, pool.shape[1], cols * pool.shape[2], pool.shape[3])

    torch.manual_seed(0)
    B, H, KV, D, S, hidden = 3, 8, 2, 16, 20, 32
    for has_norm in (True, False):
        qkv = torch.randn(B, (H + 2 * KV) * D)
        q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)  # strided views, as from the fused projection
        qn, kn = torch.randn(D), torch.randn(D)
        cos, sin = torch.randn(S, D), torch.randn(S, D)
        pos, slot = torch.tensor([3, 7, 11]), torch.tensor([9, 4, 13])  # each row its own slot
        kc, vc = torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
        valid = torch.rand(B, S) > 0.3  # padding slots are never attended
        kc_out, vc_out = kc.clone(), vc.clone()
        out = kernels.rope_attention(q, k, v, qn if has_norm else None, kn if has_norm else None, 1e-6,
                                     cos, sin, pos, slot, kc_out, vc_out, valid, 0.25, H, KV, D, block_n=4)
        # the same caches as shuffled pages of a pool, read through a block table (page 5: a tile of
        # 4 positions straddles pages)
        (kp, vp), table = paged(kc, vc, page=5)
        paged_out = kernels.rope_attention(q, k, v, qn if has_norm else None, kn if has_norm else None, 1e-6,
                                           cos, sin, pos, slot, kp, vp, valid, 0.25, H, KV, D, block_n=4, table=table)
        torch.testing.assert_close(paged_out, out)
        # split into chunks of 4 and 8 slots (flash-decoding), slot caches and pages: chunks past a
        # row's slot and chunks with no valid slot merge as empty
        for split in (4, 8):
            for caches, pages in (((kc.clone(), vc.clone()), None), paged(kc, vc, page=5)):
                split_out = kernels.rope_attention(q, k, v, qn if has_norm else None, kn if has_norm else None, 1e-6,
                                                   cos, sin, pos, slot, *caches, valid, 0.25, H, KV, D, block_n=4,
                                                   table=pages, split_positions=split)
                torch.testing.assert_close(split_out, out, rtol=1e-5, atol=1e-5)
        # the programs in another order (longest row first, a row's KV heads side by side): the same
        for split in (None, 4):
            caches, pages = paged(kc, vc, page=5)
            ordered = kernels.rope_attention(q, k, v, qn if has_norm else None, kn if has_norm else None, 1e-6,
                                             cos, sin, pos, slot, *caches, valid, 0.25, H, KV, D, block_n=4,
                                             table=pages, split_positions=split, order=torch.argsort(slot, descending=True))
            torch.testing.assert_close(ordered, out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(unpage(kp, table), kc_out)  # the new keys written in their pages
        torch.testing.assert_close(unpage(vp, table), vc_out)
        qh, kh = q.reshape(B, H, D), k.reshape(B, KV, D)
        if has_norm:
            qh, kh = _rms_norm(qh, qn, 1e-6), _rms_norm(kh, kn, 1e-6)
        c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        rows = torch.arange(B)
        kc[rows, :, slot], vc[rows, :, slot] = kh * c + _rotate_half(kh) * s, v.reshape(B, KV, D)
        torch.testing.assert_close(kc_out, kc)  # only each row's new-token slot is written
        torch.testing.assert_close(vc_out, vc)
        attend = valid.clone()
        attend[rows, slot] = True  # the new token, never a later slot
        attend &= torch.arange(S) <= slot[:, None]
        scores = torch.einsum("bhd,bhsd->bhs", qh * c + _rotate_half(qh) * s, kc.repeat_interleave(H // KV, 1)) * 0.25
        probs = scores.masked_fill(~attend[:, None], float("-inf")).softmax(-1)
        expected = torch.einsum("bhs,bhsd->bhd", probs, vc.repeat_interleave(H // KV, 1)).reshape(B, -1)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)

    # Qwen3.5's gated attention (rotary on 8 of 16 dims): paged pools equal the slot caches
    qg, kv_new = torch.randn(B, H * 2 * D), torch.randn(B, 2 * KV * D)
    k, v = kv_new.split([KV * D, KV * D], dim=-1)
    qn, kn = torch.randn(D) * 0.3, torch.randn(D) * 0.3
    cos, sin = torch.randn(S, 8), torch.randn(S, 8)
    kc, vc = torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    (kp, vp), table = paged(kc, vc, page=5)  # a tile of 8 positions straddles pages
    scratch = kp[0].clone()
    out = kernels.gated_attention(qg, k, v, qn, kn, 1e-6, cos, sin, pos, slot, kc, vc, valid, 0.25, H, KV, D, block_n=8)
    paged_out = kernels.gated_attention(qg, k, v, qn, kn, 1e-6, cos, sin, pos, slot, kp, vp, valid, 0.25, H, KV, D,
                                        block_n=8, table=table)
    torch.testing.assert_close(paged_out, out)
    torch.testing.assert_close(unpage(kp, table), kc)
    torch.testing.assert_close(unpage(vp, table), vc)
    assert torch.equal(kp[0], scratch)  # no row wrote outside its own pages

    x, delta, w = torch.randn(4, hidden), torch.randn(4, hidden), torch.randn(hidden)
    stream = x.clone()
    normed = kernels.add_rms_norm(stream, delta, w, 1e-5)
    torch.testing.assert_close(stream, x + delta)  # the residual stream is updated in place
    torch.testing.assert_close(normed, _rms_norm(x + delta, w, 1e-5))
    torch.testing.assert_close(kernels.add_rms_norm(x.clone(), None, w, 1e-5), _rms_norm(x, w, 1e-5))

    gate_up = torch.randn(4, 128)
    gate, up = gate_up.split([64, 64], dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    # the fused sampler: the same inverse-CDF draw as sampling.sample_tokens, rows from either
    # model's logits, with and without a start-token mask; and the senior's token log-probs
    from tandem_lit.rollout.sampling import SamplingConfig, sample_tokens

    V = 300
    a, b = (torch.randn(6, 320) * 3)[:, :V], (torch.randn(6, 320) * 3)[:, :V]  # row-strided, as the engine's
    pick = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.bool)
    u = torch.rand(6)
    for temperature in (0.0, 0.7, 1.0):
        for allowed in (None, torch.rand(V) > 0.5, torch.rand(6, V) > 0.5):
            want = sample_tokens(torch.where(pick[:, None], b, a), u, SamplingConfig(temperature=temperature), allowed)
            assert torch.equal(kernels.sample_rows(a, u, temperature, b, pick, allowed, block=64), want)
            want = sample_tokens(a, u, SamplingConfig(temperature=temperature), allowed)
            assert torch.equal(kernels.sample_rows(a, u, temperature, allowed=allowed, block=64), want)
    token = torch.randint(0, V, (6,))
    logp = (a / 0.7).log_softmax(-1)
    chosen = logp.gather(-1, token[:, None]).squeeze(-1)
    plain, no_sets = kernels.token_logprobs(a, token, 0.7, block=64)
    torch.testing.assert_close(plain, chosen)
    assert no_sets is None
    # handoff switches (rollout.switch): renormalised over each row's start set, and the log-mass
    # of its end set; code 0 is the whole vocabulary, and a set may be empty where no code names it
    from tandem_lit.rollout.switch import set_log_mass

    sets = torch.rand(4, V) > 0.6
    sets[3] = False
    start, end = torch.tensor([0, 1, 2, 0, 3, 1]), torch.tensor([2, 0, 1, 3, 0, 0])
    got, end_mass = kernels.token_logprobs(a, token, 0.7, sets, start, end, block=64)
    torch.testing.assert_close(got, chosen - set_log_mass(logp, sets, start))
    torch.testing.assert_close(end_mass, set_log_mass(logp, sets, end))
    assert bool((end_mass[end == 0] == 0).all()) and bool((end_mass[end > 0] < 0).all())
    print("kernels ok")
""")


def test_kernels_match_the_torch_decode_path():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernels are defined: a fresh process
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernels ok" in done.stdout


def test_the_triton_decode_step_equals_the_torch_step_with_programs_longest_row_first(repo_root):
    """StaticDecoderModel's Triton decode step (tests/interpret_decode_step.py, in the interpreter):
    the logits of its torch step, slot caches and a paged pool, with the attention programs given
    the rows longest first in every layer."""
    run = subprocess.run([sys.executable, "tests/interpret_decode_step.py"], cwd=repo_root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.split("largest logit difference ")[1].split()[0]) < 1e-5
    assert "order ok" in run.stdout


def test_longest_first_is_a_stable_descending_sort_without_sorting():
    """The row order the decode step gives its attention programs (captured in a CUDA graph, so
    counted, not sorted): torch's stable descending argsort, ties included."""
    import torch

    from tandem_lit.rollout.static.plain import longest_first

    generator = torch.Generator().manual_seed(0)
    for rows in (1, 2, 7, 128):
        slot = torch.randint(0, 5, (rows,), generator=generator)  # many ties
        assert longest_first(slot).tolist() == torch.argsort(slot, descending=True, stable=True).tolist()
    assert longest_first(torch.tensor([5, 19, 2, 11])).tolist() == [1, 3, 0, 2]
