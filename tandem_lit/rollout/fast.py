"""FastEngine: static KV caches and one CUDA-graph decode step for both models.

Decoding is memory-bandwidth bound: each step must read both models' weights and their KV
caches once. Everything else is overhead to remove: per-token Python, dynamic cache growth,
kernel launch gaps, host syncs. So:

- Prefill runs the models' own Hugging Face decoder stack once per batch (left-padded prompts of
  any lengths); its keys/values are copied into preallocated static caches.
- One decode step = senior forward + junior forward + sampling + handoff draw + author record +
  stop flags (the shared ``TandemDecoder``), written against static buffers and captured once as
  a CUDA graph per (batch size, attention length bucket, sampling/handoff settings), then
  replayed. The host looks at the finished flags every ``check_every`` steps only.
- The decode forward is a small reimplementation of the Llama-family block (Llama, Mistral,
  Qwen2, Qwen3) that reads the parameters of the model it is given. In training that is the
  senior's rollout copy (bf16, LoRA merged; ``tandem_lit.rollout.weights``), refreshed through
  ``load_weights`` after optimiser updates; with ``rollout_dtype: live`` it reads the trained
  parameters themselves, LoRA adapters included.
- On CUDA the junior's forward runs on a second stream, concurrently with the senior's (both
  read only the token just appended; they meet again at the next step's sampling), so one
  model's small latency-bound kernels fill the other's gaps. The fork/join is captured into
  the graph as two parallel branches.
- Solo policies (p=0 or p=1) skip the other model entirely, so tandem-vs-solo timings compare
  like with like. On CPU the same step runs eagerly (tests, the offline demo).
"""

from __future__ import annotations

import math
import time
from dataclasses import astuple
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.decoder import TandemDecoder
from tandem_lit.rollout.engine import RolloutEngine, eval_mode, model_prompts
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.rollout.record import PromptBatch, Rollout
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.weights import check_rollout_dtype

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # and Qwen3.5's hybrid attention: hybrid.py
_POSITION_ONLY_ROPE = ("default", "linear", "llama3", "yarn", None)


class _Linear:
    """``x W^T + b`` plus any active LoRA adapters, read from the live peft parameters."""

    def __init__(self, module: nn.Module):
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a peft LoRA layer
            base = module.base_layer
            merged = getattr(module, "merged", False)
            self.lora = [] if merged else [
                (module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]))
                for name in module.active_adapters
                if name in module.lora_A
            ]
        else:
            base, self.lora = module, []
        if not isinstance(base, nn.Linear) or not base.weight.dtype.is_floating_point:
            raise ConfigError(
                f"FastEngine reads plain linear weights; {type(base).__name__} ({base.weight.dtype}) is not one "
                "(4-bit/8-bit bases need engine: HFEngine)"
            )
        self.weight, self.bias = base.weight, base.bias

    def __call__(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        for a, b, scale in self.lora:
            y = y + F.linear(F.linear(x, a), b) * scale
        return y


class _Fused:
    """Projections of one input as one GEMM over one concatenated weight.

    Reading q/k/v (and gate/up) as one matrix is markedly faster at decode batch sizes than three
    (two) thin products. With ``share`` (the engine's own rollout copy) the parts' parameters
    become views of the fused tensor, so loading weights into them fills it: no second copy, no
    sync. Otherwise (trained weights decoded in place) the fused tensor is a copy that ``sync()``
    refreshes at the start of every rollout batch, so it never lags the policy. Only for
    projections without LoRA.
    """

    def __init__(self, parts: list[_Linear], share: bool = False):
        self.parts = parts
        self.sizes = [p.weight.shape[0] for p in parts]
        self.weight = torch.cat([p.weight.detach() for p in parts])
        has_bias = any(p.bias is not None for p in parts)
        self.bias = torch.cat([self._bias(p) for p in parts]) if has_bias else None
        self.shared = share
        if share:
            for part, weight, bias in zip(parts, self.weight.split(self.sizes), self._bias_views()):
                part.weight.data = weight
                if part.bias is not None:
                    part.bias.data = bias

    def _bias_views(self) -> list[Tensor | None]:
        return list(self.bias.split(self.sizes)) if self.bias is not None else [None] * len(self.parts)

    @staticmethod
    def _bias(part: _Linear) -> Tensor:
        w = part.weight
        return part.bias.detach() if part.bias is not None else w.new_zeros(w.shape[0])

    def sync(self) -> None:
        if self.shared:
            return
        torch.cat([p.weight.detach() for p in self.parts], out=self.weight)
        if self.bias is not None:
            torch.cat([self._bias(p) for p in self.parts], out=self.bias)

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # the same op order as transformers' LlamaRMSNorm / Qwen3RMSNorm
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = (_Linear(getattr(attn, f"{n}_proj")) for n in "qkvo")
        self.gate, self.up, self.down = _Linear(mlp.gate_proj), _Linear(mlp.up_proj), _Linear(mlp.down_proj)
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3
        self.k_norm = getattr(attn, "k_norm", None)
        self.qkv: _Fused | None = None
        self.gate_up: _Fused | None = None

    def fuse(self, share: bool) -> None:
        if not (self.q.lora or self.k.lora or self.v.lora):
            self.qkv = _Fused([self.q, self.k, self.v], share)
        if not (self.gate.lora or self.up.lora):
            self.gate_up = _Fused([self.gate, self.up], share)

    def sync(self) -> None:
        for fused in (self.qkv, self.gate_up):
            if fused is not None:
                fused.sync()

    def project_qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.qkv(h) if self.qkv is not None else (self.q(h), self.k(h), self.v(h))

    def mlp_inputs(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.gate_up(h) if self.gate_up is not None else (self.gate(h), self.up(h))


def _norm(module: nn.Module, x: Tensor) -> Tensor:
    return _rms_norm(x, module.weight, _eps(module))


def decoder_model(model: nn.Module):
    """The decode step for ``model``: ``HybridDecoderModel`` for Qwen3.5's hybrid attention,
    else ``StaticDecoderModel`` (Llama family). Raises ConfigError naming what is unsupported."""
    from tandem_lit.rollout.hybrid import HYBRID_MODEL_TYPES, HybridDecoderModel

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "model_type", None) in HYBRID_MODEL_TYPES:
        return HybridDecoderModel(model)
    return StaticDecoderModel(model)


def check_architecture(config) -> None:
    """Raise ConfigError naming what FastEngine cannot decode in this model config."""
    from tandem_lit.rollout.hybrid import HYBRID_MODEL_TYPES, HybridDecoderModel

    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
        HybridDecoderModel.check_architecture(config)
    else:
        StaticDecoderModel.check_architecture(config)


class StaticDecoderModel:
    """One Llama-family model's decode step over a static KV cache."""

    def __init__(self, model: nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        self.check_architecture(config)
        self.model = model
        self.config = config
        self.sliding_window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        inner = base.model
        self.decoder_stack = inner  # the model without its LM head (embeddings, layers, final norm)
        self.embed = inner.embed_tokens
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.final_norm = inner.norm
        self.lm_head = _Linear(base.lm_head)
        self.rotary = inner.rotary_emb
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.k_cache: list[Tensor] = []
        self.v_cache: list[Tensor] = []
        self.cos = self.sin = None

    @staticmethod
    def check_architecture(config) -> None:
        """Raise ConfigError naming what FastEngine cannot decode in this model config."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"FastEngine supports {', '.join(SUPPORTED_MODEL_TYPES)} and qwen3_5 architectures, not {model_type!r}; "
                "set the engine to HFEngine for this model"
            )
        rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        if rope_type not in _POSITION_ONLY_ROPE:
            raise ConfigError(f"FastEngine needs position-only rotary embeddings, not rope_type={rope_type!r}; use HFEngine")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"FastEngine supports SiLU MLPs, not hidden_act={config.hidden_act!r}; use HFEngine")

    def first_weight_ptr(self) -> int:
        return self.embed.weight.data_ptr()

    def fuse_projections(self, share: bool) -> None:
        for layer in self.layers:
            layer.fuse(share)

    def sync(self) -> None:
        """Refresh the fused weight copies from the live parameters."""
        for layer in self.layers:
            layer.sync()

    def allocate(self, batch: int, length: int) -> None:
        """Static caches for ``batch`` sequences of up to ``length`` tokens, and the rotary table."""
        if self.sliding_window is not None and length > self.sliding_window:
            raise ConfigError(
                f"sequences of {length} tokens exceed the model's sliding window ({self.sliding_window}); "
                "FastEngine attends to the full context: use HFEngine"
            )
        self.free()  # the old caches go before the new ones are allocated
        shape = (batch, self.kv_heads, length, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        cos, sin = self.rotary(probe, positions)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [length, head_dim]

    def free(self) -> None:
        self.k_cache, self.v_cache = [], []
        self.cos = self.sin = None

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:  # -> [B, V]
        """The model's own decoder stack over the prompts, then its LM head on the last position;
        keys/values land in slots [0, P)."""
        batch, width = input_ids.shape
        hidden, cache = prefill_with_cache(self.decoder_stack, self.config, input_ids, attention_mask)
        for i in range(len(self.layers)):
            keys, values = _layer_cache(cache, i)
            self.k_cache[i][:batch, :, :width].copy_(keys)
            self.v_cache[i][:batch, :, :width].copy_(values)
        last = hidden[:, -1:]  # what ``logits_to_keep=1`` hands the LM head (bit-equal to HFEngine on CPU)
        if last.is_cuda:
            # on that strided view cuBLAS picked a kernel that took ~10 ms instead of ~0.2
            # (H200, batch 64 x 128 prompt tokens; benchmarks/prefill.py)
            last = last.contiguous()
        return self.lm_head(last)[:, -1]

    def decode(self, token: Tensor, position: Tensor, slot: Tensor, valid: Tensor, kv_len: int, triton: bool) -> Tensor:
        """One token per sequence: write its K/V at ``slot``, attend to the valid slots up to it.

        token, position: [B] long; slot: [1] long; valid: [Bcap, S] bool -> logits [B, V].
        The torch path attends to slots [0, kv_len); the Triton path reads the bound from ``slot``.
        """
        if triton:
            return self._decode_triton(token, position, slot, valid)
        batch = token.shape[0]
        valid = valid[:batch, :kv_len]
        x = self.embed.weight[token]  # [B, H]
        cos = self.cos[position].unsqueeze(1)  # [B, 1, D]
        sin = self.sin[position].unsqueeze(1)
        mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(~valid, torch.finfo(self.dtype).min)
        mask = mask[:, None, None, :]  # [B, 1, 1, kv_len]
        group = self.heads // self.kv_heads
        for i, layer in enumerate(self.layers):
            h = _norm(layer.input_norm, x)
            q = layer.q(h).view(batch, self.heads, self.head_dim)
            k = layer.k(h).view(batch, self.kv_heads, self.head_dim)
            v = layer.v(h).view(batch, self.kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q, k = _norm(layer.q_norm, q), _norm(layer.k_norm, k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = self.k_cache[i][:batch], self.v_cache[i][:batch]
            k_cache.index_copy_(2, slot, k.unsqueeze(2))
            v_cache.index_copy_(2, slot, v.unsqueeze(2))
            keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]  # [B, KV, S, D]
            q = q.view(batch, self.kv_heads, group, self.head_dim)
            scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scaling + mask  # [B, KV, G, S]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            attended = torch.matmul(probs, values).reshape(batch, self.heads * self.head_dim)
            x = x + layer.o(attended)
            h = _norm(layer.post_norm, x)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        return self.lm_head(_norm(self.final_norm, x))

    def _decode_triton(self, token: Tensor, position: Tensor, slot: Tensor, valid: Tensor) -> Tensor:
        from tandem_lit.rollout import kernels

        x = self.embed.weight[token]  # [B, H], the residual stream (updated in place)
        delta = None
        for i, layer in enumerate(self.layers):
            h = kernels.add_rms_norm(x, delta, layer.input_norm.weight, _eps(layer.input_norm))
            attended = kernels.rope_attention(
                *layer.project_qkv(h),
                layer.q_norm.weight if layer.q_norm is not None else None,
                layer.k_norm.weight if layer.k_norm is not None else None,
                _eps(layer.q_norm) if layer.q_norm is not None else 0.0,
                self.cos, self.sin, position, slot, self.k_cache[i], self.v_cache[i], valid,
                self.scaling, self.heads, self.kv_heads, self.head_dim,
            )
            delta = layer.o(attended)
            h = kernels.add_rms_norm(x, delta, layer.post_norm.weight, _eps(layer.post_norm))
            delta = layer.down(kernels.silu_mul(*layer.mlp_inputs(h)))
        return self.lm_head(kernels.add_rms_norm(x, delta, self.final_norm.weight, _eps(self.final_norm)))


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def prefill_with_cache(decoder_stack: nn.Module, config, input_ids: Tensor, attention_mask: Tensor):
    """The model's own decoder stack over left-padded prompts: (last hidden states, its Hugging
    Face cache), for a static decoder to copy into its buffers."""
    from transformers import DynamicCache

    from tandem_lit.rollout.engine import cache_kwarg

    cache = DynamicCache(config=config)
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    hidden = decoder_stack(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
        use_cache=True, **{cache_kwarg(decoder_stack): cache},
    ).last_hidden_state
    return hidden, cache


def _layer_cache(cache, index: int) -> tuple[Tensor, Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        layer = cache.layers[index]
        return layer.keys, layer.values
    return cache.key_cache[index], cache.value_cache[index]


class _Batch:
    """Buffers shared by both models for one batch capacity: counters, masks, logits."""

    def __init__(self, capacity: int, length: int, vocab: dict[str, int], device):
        self.capacity, self.length = capacity, length
        self.t = torch.zeros(1, dtype=torch.long, device=device)  # decode step
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # cache slot of the newest token
        # per model: each may have its own prompt (own system prompt or template), so the same
        # response token sits at its own rotary position and the padding differs
        self.position = {name: torch.zeros(capacity, dtype=torch.long, device=device) for name in vocab}
        self.valid = {name: torch.zeros(capacity, length, dtype=torch.bool, device=device) for name in vocab}
        # float32: sampling and log-probs read them several times; convert once per step
        self.logits = {name: torch.zeros(capacity, vocab[name], dtype=torch.float32, device=device) for name in vocab}


class _PhaseClock:
    """Marks points of one ``generate`` without a host sync (CUDA events; the host clock on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Time between consecutive marks (waits for the last one on CUDA)."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class FastEngine(RolloutEngine):
    """Static-cache tandem engine; one CUDA graph per decode step on GPU, eager on CPU.

    Args:
        cuda_graphs: Capture and replay the decode step on CUDA devices.
        kernels: ``triton`` fused decode kernels (CUDA only), ``torch`` plain tensor ops (any
            device; bit-comparable with transformers' eager code), or ``auto``: triton on CUDA,
            torch elsewhere.
        kv_block: Attention length bucket of the torch path (tokens): each graph attends to a
            multiple of this, so short sequences do not read the whole cache.
        check_every: Look at the finished flags every this many steps (one host sync each).
        fuse_weights: With the Triton kernels, run q/k/v and gate/up as one GEMM each. The rollout
            copy and the frozen junior store those weights fused (no extra memory); trained
            weights decoded in place get a fused copy re-synced at every ``generate``.
            Projections with LoRA adapters (``rollout_dtype: live``) are never fused.
        overlap_junior: On CUDA, in tandem, run the junior's decode forward on a second stream
            concurrently with the senior's (same results; off: one stream, one after the other).
        rollout_dtype: Dtype of the senior's rollout copy (see ``RolloutEngine``; ``auto``: bf16 on
            a GPU, so a float32 or LoRA-wrapped senior decodes at bf16 speed).
    """

    def __init__(
        self,
        cuda_graphs: bool = True,
        kernels: Literal["auto", "torch", "triton"] = "auto",
        kv_block: int = 128,
        check_every: int = 16,
        fuse_weights: bool = True,
        overlap_junior: bool = True,
        rollout_dtype: str = "auto",
    ):
        if kv_block < 1 or check_every < 1:
            raise ConfigError("kv_block and check_every must be >= 1")
        if kernels not in ("auto", "torch", "triton"):
            raise ConfigError(f"kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
        self.cuda_graphs = cuda_graphs
        self.kernels = kernels
        self.fuse_weights = fuse_weights
        self.kv_block = kv_block
        self.check_every = check_every
        self.overlap_junior = overlap_junior
        self.rollout_dtype = check_rollout_dtype(rollout_dtype)

    def setup(self, senior: nn.Module, junior: nn.Module | None, tokenizer, junior_tokenizer=None) -> None:
        super().setup(senior, junior, tokenizer, junior_tokenizer)
        self.models = {"senior": decoder_model(self.senior)}
        if junior is not None:
            self.models["junior"] = decoder_model(junior)
            if self.models["junior"].device != self.models["senior"].device:
                raise ConfigError("FastEngine needs the senior and junior on the same device")
        self._batch: _Batch | None = None
        self._decoders: dict[tuple, TandemDecoder] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._weights_at_capture: dict[str, int] = {}
        self._side_stream: torch.cuda.Stream | None = None  # created on the first overlapped step
        self._last_phases: tuple[_PhaseClock, int, float, int] | None = None
        device = self.models["senior"].device
        if self.kernels == "triton" and device.type != "cuda":
            raise ConfigError("FastEngine(kernels='triton') needs a CUDA device; use kernels: torch or auto")
        self.triton = device.type == "cuda" and self.kernels != "torch"
        if self.triton and self.fuse_weights:
            # the rollout copy and the frozen junior can lend their storage to the fused
            # weights; trained weights decoded in place keep their own and are re-synced
            for name, model in self.models.items():
                model.fuse_projections(share=name == "junior" or self.decodes_copy)

    def release(self) -> None:
        """Free the KV caches, buffers and captured graphs (re-allocated and re-captured by the
        next ``generate``), so that a training update can use their memory."""
        self._decoders.clear()
        self._drop_graphs()
        self._batch = None
        for model in self.models.values():
            model.free()
        if self.models["senior"].device.type == "cuda":
            torch.cuda.empty_cache()  # graph pools hold their memory until then

    # ------------------------------------------------------------------------------ buffers

    def _ensure_capacity(self, batch: int, length: int) -> _Batch:
        current = self._batch
        if current is not None and current.capacity >= batch and current.length >= length:
            return current
        capacity = max(batch, current.capacity if current else 0)
        length = max(length, current.length if current else 0)
        length = math.ceil(length / self.kv_block) * self.kv_block
        self._decoders.clear()  # decoders and graphs hold views of the old buffers
        self._drop_graphs()
        self._batch = None
        for model in self.models.values():
            model.allocate(capacity, length)
        any_model = self.models["senior"]
        vocab = {name: m.lm_head.weight.shape[0] for name, m in self.models.items()}
        self._batch = _Batch(capacity, length, vocab, any_model.device)
        return self._batch

    def _decoder(self, policy: HandoffPolicy, sampling: SamplingConfig, batch: int) -> tuple[tuple, TandemDecoder]:
        key = (repr(policy), astuple(sampling), batch)
        if key not in self._decoders:
            device = self.models["senior"].device
            self._decoders[key] = TandemDecoder(
                policy, self.token_classes(device), sampling, batch, self.eos_token_ids, self.pad_token_id,
                fused_sampling=self.triton,
            )
        return key, self._decoders[key]

    # ------------------------------------------------------------------------------- decode

    def _step(self, decoder: TandemDecoder, batch: int, kv_len: int) -> None:
        """One decode step on the static buffers (the body a CUDA graph captures)."""
        buf = self._batch
        senior = buf.logits["senior"][:batch] if decoder.needs_senior else None
        junior = buf.logits["junior"][:batch] if decoder.needs_junior else None
        token = decoder.step(buf.t, senior, junior)
        buf.slot.add_(1)
        for name, logits in (("senior", senior), ("junior", junior)):
            if logits is not None:
                buf.position[name][:batch].add_(1)
                buf.valid[name][:batch].index_fill_(1, buf.slot, True)

        def forward(name: str, out: Tensor) -> None:
            position = buf.position[name][:batch]
            out.copy_(self.models[name].decode(token, position, buf.slot, buf.valid[name], kv_len, self.triton))

        if senior is not None and junior is not None and self._overlap():
            # The two forwards are independent until the next step's sampling, and each alone
            # leaves the GPU partly idle (latency-bound norms/attention, GEMM tails): run the
            # junior on a side stream. Fork: the side stream waits for this step's token; join:
            # the main stream waits for the junior's logits. Valid inside CUDA graph capture.
            main, side = torch.cuda.current_stream(), self._side()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                forward("junior", junior)
            forward("senior", senior)
            main.wait_stream(side)
            token.record_stream(side)  # allocated on main, read on side: no early reuse
        else:
            if senior is not None:
                forward("senior", senior)
            if junior is not None:
                forward("junior", junior)
        buf.t.add_(1)

    def _overlap(self) -> bool:
        return self.overlap_junior and self.models["senior"].device.type == "cuda"

    def _side(self) -> torch.cuda.Stream:
        # one stream for the engine's life: warm-up and capture must use the same one, so the
        # cuBLAS workspace of that stream is allocated eagerly, not inside the graph's pool
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.models["senior"].device)
        return self._side_stream

    def _graph(self, key: tuple, decoder: TandemDecoder, batch: int, kv_len: int) -> torch.cuda.CUDAGraph:
        graph_key = (key, kv_len, self._overlap())
        if graph_key not in self._graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # warm up on a side stream (lazy cuBLAS/allocator init) with in-range counters;
            # generate() resets every buffer after capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._zero_counters()
                    self._step(decoder, batch, kv_len)
            torch.cuda.current_stream().wait_stream(stream)
            self._zero_counters()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(decoder, batch, kv_len)
            self._graphs[graph_key] = graph
        return self._graphs[graph_key]

    def _zero_counters(self) -> None:
        buf = self._batch
        for counter in (buf.t, buf.slot, *buf.position.values()):
            counter.zero_()

    def _check_weights_in_place(self) -> None:
        """Graphs read parameters by address: if a model was moved or its storage replaced,
        the captured graphs are stale."""
        pointers = {name: m.first_weight_ptr() for name, m in self.models.items()}
        if self._weights_at_capture and pointers != self._weights_at_capture:
            self._drop_graphs()
        self._weights_at_capture = pointers

    def _drop_graphs(self) -> None:
        # a memory pool whose graphs are all gone cannot host new captures: start a new one
        self._graphs.clear()
        self._pool = None

    def generate(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig) -> Rollout:
        self.check_models(policy)
        device = self.models["senior"].device
        inputs = model_prompts(prompts.to(device))
        batch, width = inputs["senior"][0].shape
        use_graphs = self.cuda_graphs and device.type == "cuda"
        started = time.perf_counter()
        buf = self._ensure_capacity(batch, width + sampling.max_new_tokens)
        key, decoder = self._decoder(policy, sampling, batch)
        active = [name for name, needed in (("senior", decoder.needs_senior), ("junior", decoder.needs_junior)) if needed]
        # static caches hold the weights' dtype: decode in it, also inside a bf16-mixed training step
        no_autocast = torch.autocast(device_type=device.type, enabled=False)
        with eval_mode(*(self.models[name].model for name in active)), no_autocast:
            for name in active:
                self.models[name].sync()
            if use_graphs:
                self._check_weights_in_place()
                for t in range(sampling.max_new_tokens):
                    self._graph(key, decoder, batch, self._kv_len(width + t + 1))
            setup_seconds = time.perf_counter() - started
            decoder.reset(prompts.seeds)
            buf.t.zero_()
            buf.slot.fill_(width - 1)
            for name in active:
                mask = inputs[name][1]
                buf.position[name][:batch].copy_(mask.sum(-1) - 1)
                buf.valid[name][:batch].zero_()
                buf.valid[name][:batch, :width].copy_(mask.bool())
            clock = _PhaseClock(device)
            clock.mark()
            for name in active:
                buf.logits[name][:batch].copy_(self.models[name].prefill(*inputs[name]))
            clock.mark()
            steps = 0
            for t in range(sampling.max_new_tokens):
                if use_graphs:
                    self._graph(key, decoder, batch, self._kv_len(width + t + 1)).replay()
                else:
                    self._step(decoder, batch, width + t + 1)
                steps = t + 1
                if steps % self.check_every == 0 and decoder.all_finished():
                    break
            clock.mark()
        self._last_phases = (clock, steps, setup_seconds, width)
        return decoder.finish(prompts.to(device), self.tokenizer, steps)

    def last_timing(self) -> dict[str, float]:
        """Where the last ``generate`` spent its time: setup seconds (cache allocation and graph
        capture: zero when both are reused), prefill seconds, decode seconds and steps, and the
        decode step time; ``prompt_width``: the padded prompt tokens decoding started from."""
        if self._last_phases is None:
            raise RuntimeError("last_timing() reports on a generate() call; none has run yet")
        clock, steps, setup, width = self._last_phases
        prefill, decode = clock.seconds()
        return {
            "setup_s": setup, "prefill_s": prefill, "decode_s": decode, "decode_steps": steps,
            "decode_step_ms": 1000 * decode / max(steps, 1), "prompt_width": width,
        }

    def _kv_len(self, needed: int) -> int:
        if self.triton:  # the attention kernel reads its bound on the device: one graph for all steps
            return self._batch.length
        return min(math.ceil(needed / self.kv_block) * self.kv_block, self._batch.length)
