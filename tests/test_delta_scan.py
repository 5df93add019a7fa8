"""Qwen3.5's chunked gated delta rule with the scan in Triton (``models.delta_scan``, issue 26):
the torch path equals transformers' rule (outputs, final state, every gradient); the Triton kernels,
in Triton's CPU interpreter, equal the torch scan; compiled on a GPU, the whole rule equals
transformers' at the 9B's shape; and ``float32_delta_rule`` routes a Qwen3.5 model through it on
CUDA (here: on a device list that names the CPU) while leaving the CPU path as it was."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tandem_lit.models import delta_scan
from tandem_lit.models.delta_scan import chunk_gated_delta_rule
from tandem_lit.rollout import logprobs

qwen35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def unwrapped_rule():
    """transformers' rule as its module defines it, whether or not ``float32_delta_rule`` has run."""
    rule = qwen35.torch_chunk_gated_delta_rule
    return rule.__wrapped__ if getattr(rule, "autocast_off", False) else rule


def transformers_rule():
    """transformers' rule (``unwrapped_rule``), fewer key than value heads repeated before it as
    its layer does in transformers 5.17 (whose rule takes equal heads only; later rules repeat them
    inside). The repeat is in the graph: key and query gradients come back summed over the heads."""
    rule = unwrapped_rule()

    def with_repeated_heads(query, key, value, **kwargs):
        repeat = value.shape[2] // query.shape[2]
        return rule(query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2), value, **kwargs)

    return with_repeated_heads


def layer_inputs(batch, length, k_heads, v_heads, k_dim, v_dim, initial, device="cpu", seed=0):
    """Random inputs as a Gated DeltaNet layer hands them over (g <= 0, beta in (0, 1)), leaves with grads."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    inputs = {
        "query": rand(batch, length, k_heads, k_dim), "key": rand(batch, length, k_heads, k_dim),
        "value": rand(batch, length, v_heads, v_dim), "g": -torch.rand(batch, length, v_heads, generator=generator),
        "beta": torch.rand(batch, length, v_heads, generator=generator),
        "initial_state": rand(batch, v_heads, k_dim, v_dim) * 0.1 if initial else None,
    }
    return {name: x.to(device).requires_grad_() for name, x in inputs.items() if x is not None}


def output_and_grads(rule, inputs, seed=1):
    """The rule's output and final state, and the gradients of every input for a random projection of both."""
    out, final = rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    generator = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=generator).to(out.device)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=generator).to(out.device)).sum()
    return out, final, dict(zip(inputs, torch.autograd.grad(loss, list(inputs.values())), strict=True))


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("initial", [False, True])
def test_the_torch_scan_equals_transformers_rule(initial):
    inputs = layer_inputs(2, 150, 2, 4, 32, 32, initial)  # 3 chunks, the last one padded; 2 value heads per key head
    want_out, want_final, want_grads = output_and_grads(transformers_rule(), inputs)
    out, final, grads = output_and_grads(chunk_gated_delta_rule, inputs)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_solving_each_chunk_through_its_inverse_equals_the_two_triangular_solves():
    """``solve="inverse"`` (one solve against the identity, then two products) against the two
    solves transformers runs: outputs, final state and every gradient, to float32 rounding; with
    near-collinear keys and betas near 1 too, where the systems are least benign."""
    from functools import partial

    for seed, spread in ((0, 1.0), (3, 0.05)):
        inputs = layer_inputs(2, 150, 2, 4, 32, 32, initial=True, seed=seed)
        with torch.no_grad():  # keys close to one direction: large off-diagonal terms in every system
            base = inputs["key"][:, :1].clone()
            inputs["key"].copy_(base + spread * inputs["key"])
            inputs["beta"].copy_(0.5 + 0.5 * inputs["beta"])
        want_out, want_final, want_grads = output_and_grads(partial(chunk_gated_delta_rule, solve="triangular"), inputs)
        out, final, grads = output_and_grads(partial(chunk_gated_delta_rule, solve="inverse"), inputs)
        assert relative_error(out, want_out) < 1e-5 and relative_error(final, want_final) < 1e-5
        for name, grad in grads.items():
            assert relative_error(grad, want_grads[name]) < 1e-4, name


def test_the_final_state_is_none_unless_asked_and_the_output_keeps_the_input_dtype():
    inputs = {name: x.detach() for name, x in layer_inputs(1, 70, 1, 2, 16, 32, initial=False).items()}
    inputs["value"] = inputs["value"].bfloat16()
    out, final = chunk_gated_delta_rule(**{**inputs, "query": inputs["query"].bfloat16()})
    want, _ = transformers_rule()(**{**inputs, "query": inputs["query"].bfloat16()})
    assert final is None and out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want)


CHECK = textwrap.dedent("""
    import torch

    from tandem_lit.models.delta_scan import scan_reference
    from tandem_lit.models.delta_scan_kernels import scan_triton

    # q, k, w [B, H, N, C, K]; u [B, H, N, C, V]; attn [B, H, N, C, C]; decay [B, H, N]; state [B, H, K, V].
    # (K, V, block_v) = (32, 32, 16): two value blocks whose partial sums torch adds; (24, 40, 16): padded
    # tiles on both dimensions and a last value block only half used
    torch.manual_seed(0)
    for (B, H, N, C, K, V, block_v) in [(1, 2, 3, 64, 32, 32, 16), (2, 1, 2, 16, 24, 40, 16)]:
        for initial in (False, True):
            terms = [torch.randn(B, H, N, C, K) * 0.3, torch.randn(B, H, N, C, K) * 0.3, torch.randn(B, H, N, C, V),
                     torch.randn(B, H, N, C, K) * 0.1, torch.randn(B, H, N, C, C).tril() * 0.1,
                     torch.rand(B, H, N) * 0.5 + 0.5]
            if initial:
                terms.append(torch.randn(B, H, K, V))
            terms = [x.requires_grad_() for x in terms]
            state = terms[6] if initial else None
            want_out, want_final = scan_reference(*terms[:6], state)
            out, final = scan_triton(*terms[:6], state, block_v=block_v)
            torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(final, want_final, rtol=1e-4, atol=1e-4)
            d_out, d_final = torch.randn_like(out), torch.randn_like(final)
            # with the final state's gradient, and without (the final state unused: its gradient None)
            for with_final in (True, False):
                want_loss = (want_out * d_out).sum() + ((want_final * d_final).sum() if with_final else 0)
                loss = (out * d_out).sum() + ((final * d_final).sum() if with_final else 0)
                want = torch.autograd.grad(want_loss, terms, retain_graph=True)
                got = torch.autograd.grad(loss, terms, retain_graph=True)
                for name, g, w in zip("q k u w attn decay state".split(), got, want):
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=name)
    print("delta scan ok")
""")


def interpreter_runs_loop_bounds() -> bool:
    """Triton 3.6's interpreter cannot take a loop bound passed as an argument (``range(N)``: 'only
    0-dimensional arrays can be converted to Python scalars'); 3.9's can. Where it cannot (torch
    2.11's Triton, a GPU machine), the compiled test below checks the kernels instead."""
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the Triton kernels need the triton package")
@pytest.mark.skipif(importlib.util.find_spec("triton") is not None and not interpreter_runs_loop_bounds(),
                    reason="this Triton's interpreter cannot run loop bounds passed as arguments (< 3.7)")
def test_the_triton_scan_equals_the_torch_scan_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernels are defined: a fresh process
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "delta scan ok" in done.stdout
    print(f"interpreted in {time.perf_counter() - start:.1f} s")


@pytest.mark.gpu
def test_the_compiled_rule_equals_transformers_at_the_9b_shape():
    # Qwen3.5-9B's linear attention: 32 value heads of 128, its 16 key heads repeated to 32 before
    # the rule (transformers 5.17's layer does that; later versions' rules repeat them inside and
    # take either, so equal heads compare on both); 2 rows of 1,000 tokens
    inputs = layer_inputs(2, 1000, 32, 32, 128, 128, initial=True, device="cuda")
    inputs["value"] = (inputs["value"] * 0.05).detach().requires_grad_()
    with torch.autocast("cuda", enabled=False):
        want_out, want_final, want_grads = output_and_grads(transformers_rule(), inputs)
        out, final, grads = output_and_grads(chunk_gated_delta_rule, inputs)
    assert relative_error(out, want_out) < 1e-4
    assert relative_error(final, want_final) < 1e-4
    for name, grad in grads.items():
        assert relative_error(grad, want_grads[name]) < 1e-4, name


@pytest.fixture
def unpatched(monkeypatch):
    """transformers' rule in its module again for the test (whatever ran before), restored after."""
    monkeypatch.setattr(qwen35, "torch_chunk_gated_delta_rule", unwrapped_rule())


@pytest.mark.usefixtures("unpatched")
def test_float32_delta_rule_routes_a_built_qwen35_model_and_keeps_the_cpu_path(monkeypatch):
    from tests.test_hybrid_engine import hybrid

    model = hybrid(vocab=40, seed=0).train()  # built before the patch: its layers must still reach it
    ids = torch.randint(3, 40, (2, 90), generator=torch.Generator().manual_seed(0))  # two chunks

    def logits_and_grad():
        model.zero_grad()
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        return logits.detach(), model.model.layers[0].linear_attn.in_proj_qkv.weight.grad.clone()

    want_logits, want_grad = logits_and_grad()
    logprobs.float32_delta_rule()
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].device.type)
        return chunk_gated_delta_rule(*args, **kwargs)

    monkeypatch.setattr(logprobs, "chunk_gated_delta_rule", counted)
    logits, grad = logits_and_grad()  # the CPU (not in TRITON_SCAN_DEVICES): transformers' rule, as before the patch
    assert not calls
    assert torch.equal(logits, want_logits) and torch.equal(grad, want_grad)
    monkeypatch.setattr(logprobs, "TRITON_SCAN_DEVICES", frozenset({"cpu", "cuda"}))  # as on a device that runs the kernels
    # the chunk systems solved as transformers solves them, so that only the routing is under test
    # (the default solve, through the inverse, against this one:
    # test_solving_each_chunk_through_its_inverse_equals_the_two_triangular_solves)
    monkeypatch.setattr(delta_scan, "SOLVE", "triangular")
    logits, grad = logits_and_grad()
    assert calls == ["cpu"] * 3  # each linear-attention layer, once (the backward reuses the forward's graph)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-6)
