"""Liger's kernels against PyTorch's on CPU, in Triton's interpreter (run by tests/test_liger.py
in a fresh process with ``TRITON_INTERPRET=1``: Triton reads it when kernels are defined).

On tiny float32 Llama, Qwen3 (per-head q/k norms), Qwen3.5 (zero-centred norms, a Gated DeltaNet
layer, no rotary) and LoRA-on-Qwen3 models, ragged rows padded and packed, temperature 0.7: the
completion log-probs and every trained parameter's gradient with ``apply_liger`` and the fused head equal the plain
path's; a second model of the same class (a junior) still runs transformers' code, bit for bit;
``remove_liger`` gives the plain path back. Prints each case, then ``ok``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

from tandem_lit.models import liger
from tandem_lit.rollout import logprobs
from tandem_lit.rollout.logprobs import completion_logprobs
from tests.conftest import ragged_rollout, tiny_llama

# Two gaps of the interpreter that Liger's kernels hit: it hands float arguments to the kernel as
# Python floats (no ``.to``; compiled Triton passes fp32 scalars), and has no libdevice ``rsqrt``.
_convert = interpreter._implicit_cvt


def _with_floats(arg):
    if isinstance(arg, float):
        return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
    return _convert(arg)


interpreter._implicit_cvt = _with_floats
import liger_kernel.ops.rms_norm  # noqa: E402  (after the interpreter is set up)
import liger_kernel.ops.rope  # noqa: E402

liger_kernel.ops.rms_norm.rsqrt = lambda x: tl.math.rsqrt(x)

ROPE_CALLS = []
_rope = liger_kernel.ops.rope.LigerRopeFunction.apply
liger_kernel.ops.rope.LigerRopeFunction.apply = lambda *args: ROPE_CALLS.append(1) or _rope(*args)


def qwen3(vocab: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, initializer_range=0.1)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def qwen35(vocab: int, seed: int):
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                               linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
                               initializer_range=0.1)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():  # zero-centred norm weights start at 0: spread them so that (1 + w) is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    return model


def lora_qwen3(vocab: int, seed: int):
    """LoRA adapters (random, so that they count) on every linear layer of the MLPs and attention."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(qwen3(vocab, seed), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


MODELS = {"llama": lambda vocab, seed: tiny_llama(vocab, seed=seed, init_range=0.1), "qwen3": qwen3, "qwen3_5": qwen35,
          "qwen3-lora": lora_qwen3}
CASES = [("llama", False), ("qwen3", True), ("qwen3_5", False), ("qwen3-lora", False)]


def logprobs_and_grads(model, rollout, packed: bool, fused: bool):
    written = rollout.completion_mask
    weights = torch.linspace(-1, 1, written.numel()).view_as(written) * written
    logp = completion_logprobs(model, rollout, 0.7, packed=packed, fused=fused, vocab=SAMPLED_VOCAB)
    return logp, torch.autograd.grad((logp * weights).sum(), [p for p in model.parameters() if p.requires_grad])


SAMPLED_VOCAB = 32  # the engine's tokens: the head's last 8 rows are padding (its slice goes to the fused head)


def with_switches(rollout):
    """The rollout with handoff switch codes (rollout.switch): start sets at some tokens, a senior
    span's end at others, so that the fused head's log-probs carry the switch terms too."""
    generator = torch.Generator().manual_seed(1)
    sets = torch.rand(4, SAMPLED_VOCAB, generator=generator) > 0.5
    start, end = (torch.zeros_like(rollout.author) for _ in range(2))
    start[0, [2, 5]], start[2, 1] = torch.tensor([1, 3], dtype=torch.int8), 2
    end[0, [3, 8]], end[2, 4] = torch.tensor([2, 4], dtype=torch.int8), 4
    return dataclasses.replace(rollout, start_set=start, end_set=end, token_sets=sets)


def check(architecture: str, packed: bool) -> None:
    vocab = 40
    model, rollout = MODELS[architecture](vocab, 3).train(), with_switches(ragged_rollout(SAMPLED_VOCAB))
    junior = MODELS[architecture](vocab, 4).eval()
    layers = liger.causal_lm(model).model.layers
    kernels = liger.ARCHITECTURES[liger.causal_lm(model).config.model_type].kernels
    with torch.no_grad():
        junior_before = junior(rollout.prompt_ids).logits
    plain, plain_grads = logprobs_and_grads(model, rollout, packed, fused=False)
    liger.apply_liger(model, kernels)
    patched = [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert len(patched) >= 2 * len(layers), patched
    ROPE_CALLS.clear()
    fused, fused_grads = logprobs_and_grads(model, rollout, packed, fused=True)
    assert len(ROPE_CALLS) == (len(layers) if "rope" in kernels else 0), ROPE_CALLS
    written = rollout.completion_mask
    torch.testing.assert_close(fused[written], plain[written], rtol=2e-5, atol=2e-5)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(trained, fused_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
    with torch.no_grad():  # the same class, not patched: transformers' code, bit for bit
        assert torch.equal(junior(rollout.prompt_ids).logits, junior_before)
    assert len(ROPE_CALLS) == (len(layers) if "rope" in kernels else 0)
    assert not any("forward" in m.__dict__ for m in junior.modules())
    liger.remove_liger(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(completion_logprobs(model, rollout, 0.7, packed=packed, vocab=SAMPLED_VOCAB), plain.detach())


def check_llama_norm_kernel() -> None:
    """Liger's RMSNorm with ``llama`` casting against transformers' norm, output and gradients:
    the float32 models above run torch's fused op for their norms (``liger._rms_norm_forward``),
    so Liger's kernel, which a GPU runs for the bf16 q/k norms, is checked on its own."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 16, requires_grad=True)
    out_grad = torch.randn(5, 16)
    plain = norm(x)
    plain_grads = torch.autograd.grad(plain, [x, norm.weight], out_grad)
    kernel = LigerRMSNormFunction.apply(x, norm.weight, 1e-6, 0.0, "llama", False, None)
    kernel_grads = torch.autograd.grad(kernel, [x, norm.weight], out_grad)
    torch.testing.assert_close(kernel, plain, rtol=1e-5, atol=1e-6)
    for a, b in zip(kernel_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    torch.set_num_threads(1)
    logprobs.CHUNK_ELEMENTS = 4 * 40  # several chunks in both heads
    for architecture, packed in CASES:
        check(architecture, packed)
        print(f"{architecture}-{'packed' if packed else 'padded'}", flush=True)
    check_llama_norm_kernel()
    print("llama-norm-kernel")
    print("ok")
