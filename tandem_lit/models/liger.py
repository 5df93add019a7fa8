"""Liger-Kernel's Triton kernels in the senior's training forward (``memory.fused_kernels``).

PyTorch runs an RMSNorm, SwiGLU's ``silu(gate) * up`` and a rotary embedding as chains of small
elementwise kernels, each a round trip through GPU memory, and their backward passes as more of
them; liger-kernel (``pip install 'tandem-lit[liger]'``, pinned to 0.8.5) runs each as one Triton
kernel per direction. Its fused linear cross-entropy (``reduction="none"``) gives each token's
``-log p`` without materialising the [tokens, vocabulary] logits, in place of our chunked head
(``rollout.logprobs.completion_logprobs(fused=True)``). Which of them pay is in dev/log.md;
the update's MFU with them is on docs/performance.md.

Only the senior's own module instances change: the junior, a frozen reference copy and the
engine's rollout copy (built from the config, not copied) keep transformers' code, so rollouts do
not change (an engine that decodes the trained senior in place, ``rollout_dtype: live``, decodes
with the senior's kernels). Liger's own ``apply_liger_kernel_to_*`` replace transformers'
module-level classes and functions for every model built afterwards, so they are not used here.
Rotary embeddings are a module-level function that the attention's forward looks up at call time:
it becomes one that runs Liger's kernel inside a patched attention module's forward (a context
variable set there, also when gradient checkpointing re-runs it) and transformers' own everywhere
else.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
import types
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from tandem_lit.errors import ConfigError

log = logging.getLogger(__name__)

FusedKernels = Literal["auto", "liger", "off"]
INSTALL = "pip install 'tandem-lit[liger]' (liger-kernel==0.8.5; it needs Triton and a CUDA GPU)"


@dataclass(frozen=True)
class Architecture:
    """Which Liger kernels fit an architecture, and how its RMSNorm rounds (Liger's casting modes:
    ``llama`` rounds the normalised input to its dtype before the weight, ``gemma`` computes
    ``x * (offset + w)`` in float32 and rounds once)."""

    kernels: tuple[str, ...]
    norm_offset: float = 0.0
    norm_casting: str = "llama"
    norm_in_place: bool = True


LLAMA_FAMILY = Architecture(("rms_norm", "swiglu", "rope", "logprobs"))
ARCHITECTURES = {
    "llama": LLAMA_FAMILY, "mistral": LLAMA_FAMILY, "qwen2": LLAMA_FAMILY, "qwen3": LLAMA_FAMILY,
    # Qwen3.5: zero-centred norms (x * (1 + w)); partial rotary, which Liger's kernel does not do;
    # the Gated DeltaNet layers' gated norm and recurrence stay transformers' (or fla's)
    "qwen3_5_text": Architecture(("rms_norm", "swiglu", "logprobs"), norm_offset=1.0, norm_casting="gemma", norm_in_place=False),
}

_IN_PATCHED_ATTENTION = contextvars.ContextVar("tandem_lit_liger_rope", default=False)


def causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def liger_missing() -> str | None:
    """Why liger-kernel cannot be imported here (None: it can)."""
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
        import liger_kernel.ops.rms_norm  # noqa: F401
        import liger_kernel.ops.rope  # noqa: F401
        import liger_kernel.ops.swiglu  # noqa: F401
    except ImportError as err:
        if err.name == "liger_kernel":
            return "liger-kernel is not installed"
        return f"liger-kernel does not import ({err})"  # Triton missing, or a liger-kernel without these ops
    return None


def unsupported(model: nn.Module) -> str | None:
    """Why Liger's kernels do not fit ``model`` (None: they do)."""
    lm = causal_lm(model)
    config = lm.config
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"the senior's architecture {kind!r} is not one Liger's kernels are wired for ({', '.join(sorted(ARCHITECTURES))})"
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"the senior's MLP activation is {config.hidden_act!r}, not SwiGLU's silu"
    if getattr(config, "final_logit_softcapping", None):
        return "the senior caps its logits (final_logit_softcapping), which the fused log-prob head does not"
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return f"the senior's output head is a {type(head).__name__} (LoRA on lm_head?), not a plain bias-free Linear"
    decoder = lm.base_model
    if not hasattr(decoder, "norm") or not hasattr(decoder, "layers"):
        return f"{type(decoder).__name__} has no final norm and layer list where Liger's kernels go"
    mlp = decoder.layers[0].mlp
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
        return f"{type(mlp).__name__} is not a gate/up/down SwiGLU MLP"
    if "rope" in ARCHITECTURES[kind].kernels and not all(rope_hookable(type(a)) for a in attentions(decoder)):
        return "this transformers version's attention does not call a module-level apply_rotary_pos_emb"
    return None


def resolve(mode: FusedKernels, model: nn.Module, device: torch.device) -> tuple[str, ...]:
    """The Liger kernels the senior's training forward uses under ``memory.fused_kernels: mode``.

    ``off``: none. ``auto``: all that fit the senior when liger-kernel imports and the senior trains
    on a CUDA GPU; otherwise none, said in one log line (results are the same either way, to bf16
    rounding; only speed and memory differ). ``liger``: the same kernels, and a ConfigError instead
    of the log line when they cannot run.
    """
    if mode == "off":
        return ()
    if device.type != "cuda":
        reason = f"its Triton kernels need a CUDA GPU and the senior trains on {device.type}"
    else:
        reason = liger_missing() or unsupported(model)
    if reason is None:
        kernels = ARCHITECTURES[causal_lm(model).config.model_type].kernels
        log.info("Liger-Kernel %s in the senior's training forward: %s", liger_version(), ", ".join(kernels))
        return kernels
    fix = INSTALL if "liger-kernel" in reason else "set memory.fused_kernels: auto or off"
    if mode == "liger":
        raise ConfigError(f"memory.fused_kernels is liger, but {reason}: {fix}")
    log.info("Liger-Kernel not used: %s; the update runs PyTorch's kernels (same results, slower)%s",
             reason, f". To use it: {INSTALL}" if "liger-kernel" in reason else "")
    return ()


def liger_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return "(version unknown)"


# ------------------------------------------------------------------------------ patching


def attentions(decoder: nn.Module) -> list[nn.Module]:
    """The full-attention modules of a decoder's layers (Qwen3.5's linear-attention layers have none)."""
    return [layer.self_attn for layer in decoder.layers if hasattr(layer, "self_attn")]


def rope_hookable(attention_class: type) -> bool:
    """The attention's forward looks up ``apply_rotary_pos_emb`` in its module at call time."""
    module = sys.modules.get(attention_class.__module__)
    code = getattr(inspect.unwrap(attention_class.forward), "__code__", None)
    return callable(getattr(module, "apply_rotary_pos_emb", None)) and code is not None and "apply_rotary_pos_emb" in code.co_names


def apply_liger(model: nn.Module, kernels: tuple[str, ...] | list[str]) -> None:
    """Run ``kernels`` (of "rms_norm", "swiglu", "rope"; "logprobs" is the caller's head) in
    ``model``'s own modules. Idempotent; ``remove_liger`` undoes it."""
    kernels = set(kernels)
    if not kernels & {"rms_norm", "swiglu", "rope"}:
        return
    lm = causal_lm(model)
    architecture = ARCHITECTURES[lm.config.model_type]
    decoder = lm.base_model
    if "rms_norm" in kernels:
        norm_class = type(decoder.norm)
        eps = getattr(decoder.norm, "variance_epsilon", None) or getattr(decoder.norm, "eps", None) or 1e-6
        for module in lm.modules():
            if type(module) is norm_class:
                module.liger_rms_norm = (eps, architecture.norm_offset, architecture.norm_casting, architecture.norm_in_place)
                module.forward = types.MethodType(_rms_norm_forward, module)
    if "swiglu" in kernels:
        mlp_class = type(decoder.layers[0].mlp)
        for module in lm.modules():
            if type(module) is mlp_class:
                module.forward = types.MethodType(_swiglu_forward, module)
    if "rope" in kernels:
        for attention in attentions(decoder):
            _install_rope_dispatch(type(attention))
            attention.forward = types.MethodType(_rope_scoped_forward, attention)


def remove_liger(model: nn.Module) -> None:
    """transformers' forwards back in every module ``apply_liger`` changed."""
    for module in causal_lm(model).modules():
        if "forward" in module.__dict__ and getattr(module.forward, "__func__", None) in (_rms_norm_forward, _swiglu_forward, _rope_scoped_forward):
            del module.forward
            module.__dict__.pop("liger_rms_norm", None)


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    eps, offset, casting, in_place = self.liger_rms_norm
    if offset == 0.0 and hidden_states.dtype == self.weight.dtype:
        # where the input and the weight share a dtype (the float32 residual stream's norms under
        # autocast) transformers' norm is ``w * x * rsqrt(mean(x^2) + eps)`` in that dtype, which
        # is torch's own fused op, several times faster a call than Liger's norm, whose
        # Python-side launch is most of its time at these shapes (dev/log.md). A bf16 input with a float32 weight
        # (q/k norms) rounds before the weight: Liger's ``llama`` casting does that
        return nn.functional.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, eps)
    return LigerRMSNormFunction.apply(hidden_states, self.weight, eps, offset, casting, in_place, None)


def _swiglu_forward(self, x: Tensor) -> Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def _rope_scoped_forward(self, *args, **kwargs):
    token = _IN_PATCHED_ATTENTION.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _IN_PATCHED_ATTENTION.reset(token)


def _install_rope_dispatch(attention_class: type) -> None:
    """Replace the attention module's ``apply_rotary_pos_emb`` (once) by one that runs Liger's
    kernel inside a patched attention's forward only."""
    module = sys.modules[attention_class.__module__]
    original = module.apply_rotary_pos_emb
    if getattr(original, "liger_dispatch", False):
        return

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _IN_PATCHED_ATTENTION.get() and not args and kwargs.get("unsqueeze_dim", 1) == 1:
            from liger_kernel.ops.rope import LigerRopeFunction

            return LigerRopeFunction.apply(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.liger_dispatch = True
    apply_rotary_pos_emb.__wrapped__ = original
    module.apply_rotary_pos_emb = apply_rotary_pos_emb


# -------------------------------------------------------------------------- log-prob head


def liger_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, budget: int, vocab: int | None = None,
) -> Tensor:  # -> [..]
    """log p(target) of each position of ``hidden`` [..., H] under the head ``weight`` [V, H] with
    logits divided by ``temperature`` (if > 0), through Liger's fused linear cross-entropy: logits
    in chunks of about ``budget`` elements, never all at once; gradients to ``hidden`` and
    ``weight`` computed chunk by chunk in the backward pass. ``vocab``: normalise over the first
    ``vocab`` logits only (None: all V).

    The softmax is limited to ``vocab`` by a bias of -1e9 on the head's other rows, not by slicing
    the weight: a slice of 151,669 of Qwen's 151,936 rows gives the logits an odd row stride,
    which cuBLAS cannot feed to Hopper's TMA kernels, so it falls back to sm75 kernels at about a
    third of their speed (a large share of an update's GPU time, profiled: dev/log.md).

    Our chunked head rounds the logits to the compute dtype and then divides by the temperature;
    here the hidden states are divided first (the kernel has no temperature), so under bf16 the
    two round differently (bf16 rounding of the logits; exact in float32). Under autocast both
    operands go in in the autocast dtype, cast once per call (Lightning's autocast keeps no cast
    cache, and a float32 head weight would otherwise be cast per chunk); the weight gradient
    accumulates in float32.
    """
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    if targets.numel() == 0:
        return hidden.new_zeros(targets.shape, dtype=torch.float32)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if not torch.is_grad_enabled():
        # the kernel computes its gradients in the forward for every input that requires grad,
        # grad mode or not: a no-grad call (the old log-probs) with a weight already in the
        # compute dtype (``.to`` returns the parameter itself) would pay for a backward
        hidden, weight = hidden.detach(), weight.detach()
    flat = hidden.reshape(-1, hidden.shape[-1]).float()
    if temperature > 0:
        flat = flat / temperature
    rows, width = flat.shape
    vocabulary = weight.shape[0]
    # Liger's chunk: next_pow2(rows / ceil(V / (C * H))) rows; pick C for ~budget logits (<= 2x)
    pieces = max(1, -(-rows * vocabulary // budget))
    memory_factor = max(1, vocabulary // (pieces * width))
    outside = None
    if vocab is not None and vocab < vocabulary:  # finite: no inf - inf in the kernel's online softmax
        outside = torch.zeros(vocabulary, dtype=dtype, device=weight.device)
        outside[vocab:] = -1e9
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        flat.to(dtype), weight.to(dtype), targets.reshape(-1), outside, None, -100, 0.0, 0.0, "none", None, False,
        torch.float32, False, False, False, None, None, memory_factor,
    )[0]
    return -loss.view(targets.shape)
