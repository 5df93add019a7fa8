"""FastEngine's decode step for hybrid-attention models: Qwen3.5 (Gated DeltaNet + gated full attention).

Qwen3.5 stacks three linear-attention layers (Gated DeltaNet) for every full-attention layer.
A linear-attention layer keeps, per sequence, a fixed-size state instead of a growing KV cache:

- the short convolution's last ``K`` inputs (``[B, conv_dim, K]``, K = 4), and
- the delta rule's recurrent state (``[B, value_heads, key_dim, value_dim]``, float32).

Both live in static buffers next to the full-attention layers' KV caches, and one decode step
updates them in place (torch ops; on a GPU two Triton kernels per layer: the convolution, then
everything from q/k normalisation to the gated norm), so the whole tandem step, both models, is
still one CUDA graph. The step, per linear layer:

    x = silu(conv(last K projected inputs))           -> q, k, v (q, k L2-normalised, q / sqrt(dk))
    S = S * exp(g);  S += k (beta * (v - S^T k))^T    (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b))
    o = S^T q  ->  RMSNorm(o) * silu(z)  ->  out_proj

and the full-attention layers differ from Qwen3's by an output gate (``q_proj`` also yields a
sigmoid gate per head), rotary embeddings on the first quarter of each head only, and
zero-centred RMSNorm weights (``x * (1 + w)``). The prompt is prefilled by the model's own
Hugging Face forward, whose cache is then copied into the static buffers.

A random Qwen3.5 carries any rounding difference through all its layers (a Qwen3 washes them out),
so the decode step rounds where the training forward rounds under bf16 autocast over float32
weights: the residual stream stays float32, norms and the delta rule compute in float32 and round
once before a projection, and the rollout copy keeps ``A_log``, ``dt_bias`` and the norms' weights
in float32 (``rollout.weights.keeps_float32``). ``dev/benchmarks/logp_gap.py`` takes the gap apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.static.blocks import (
    Fused,
    Linear,
    layer_cache,
    page_slots,
    prefill_with_cache,
    read_pages,
    rotate_half,
    store_prompt_kv,
    write_pages,
)

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


def _norm_1p(module: nn.Module, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Qwen3.5's zero-centred RMSNorm: normalise in float32, scale by (1 + w), cast to ``dtype``
    (default: x's)."""
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + module.eps)
    return (out * (1.0 + module.weight.float())).to(dtype or x.dtype)


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class _DeltaLayer:
    """One Gated DeltaNet layer's weights and its static per-sequence state."""

    def __init__(self, module: nn.Module):

        self.module = module
        self.qkv, self.z, self.b, self.a = (Linear(getattr(module, f"in_proj_{n}")) for n in ("qkv", "z", "b", "a"))
        self.out = Linear(module.out_proj)
        self.conv_weight = module.conv1d.weight  # [conv_dim, 1, K]
        self.kernel = module.conv_kernel_size
        self.k_heads, self.v_heads = module.num_k_heads, module.num_v_heads
        self.k_dim, self.v_dim = module.head_k_dim, module.head_v_dim
        self.key_size = self.k_heads * self.k_dim
        self.in_proj = None  # qkv, z, b, a as one GEMM (``fuse``)
        self.conv_state: Tensor | None = None  # [B, conv_dim, K]
        self.state: Tensor | None = None  # [B, v_heads, k_dim, v_dim] float32

    def fuse(self, share: bool) -> None:

        parts = [self.qkv, self.z, self.b, self.a]
        if not any(p.lora for p in parts):
            self.in_proj = Fused(parts, share)

    def allocate(self, batch: int, device, dtype) -> None:
        conv_dim = self.conv_weight.shape[0]
        self.conv_state = torch.zeros(batch, conv_dim, self.kernel, dtype=dtype, device=device)
        self.state = torch.zeros(batch, self.v_heads, self.k_dim, self.v_dim, dtype=torch.float32, device=device)

    def free(self) -> None:
        self.conv_state = self.state = None

    def move_rows(self, sources: Tensor) -> None:
        for state in (self.conv_state, self.state):
            state[: len(sources)] = state[sources]

    def step_fused(self, h: Tensor) -> Tensor:  # [B, H] -> [B, H]
        """The same step in two Triton kernels (GPU), over one fused input projection if present."""
        from tandem_lit.rollout.static import kernels

        batch, m = h.shape[0], self.module
        qkv, z, b, a = self.in_proj(h) if self.in_proj is not None else (self.qkv(h), self.z(h), self.b(h), self.a(h))
        mixed = kernels.conv_silu_step(qkv, self.conv_state[:batch], self.conv_weight.squeeze(1))
        out = kernels.delta_rule_step(
            mixed, a, b, z, m.A_log, m.dt_bias, m.norm.weight, self.state[:batch], self.k_heads, m.norm.variance_epsilon
        )
        return self.out(out)

    def step(self, h: Tensor) -> Tensor:  # [B, H] -> [B, H]
        batch = h.shape[0]
        conv_state, state = self.conv_state[:batch], self.state[:batch]
        # the short causal convolution over the last K inputs, this one included
        window = torch.cat([conv_state[:, :, 1:], self.qkv(h).unsqueeze(-1)], dim=-1)
        conv_state.copy_(window)
        # accumulated in float32 and rounded once, as conv1d (training) and the Triton kernel do
        conv = (window.float() * self.conv_weight.squeeze(1).float()).sum(-1).to(h.dtype)
        mixed = F.silu(conv)  # [B, conv_dim]
        q, k, v = mixed.split([self.key_size, self.key_size, self.v_heads * self.v_dim], dim=-1)
        q = _l2norm(q.view(batch, self.k_heads, self.k_dim).float()) * self.k_dim**-0.5
        k = _l2norm(k.view(batch, self.k_heads, self.k_dim).float())
        v = v.view(batch, self.v_heads, self.v_dim).float()
        group = self.v_heads // self.k_heads
        if group > 1:  # each key head serves `group` consecutive value heads
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        m = self.module
        beta = torch.sigmoid(self.b(h)).float()  # [B, Hv]
        g = -m.A_log.float().exp() * F.softplus(self.a(h).float() + m.dt_bias)
        decayed = state * g.exp()[..., None, None]
        remembered = (decayed * k.unsqueeze(-1)).sum(-2)  # S^T k: [B, Hv, Dv]
        delta = (v - remembered) * beta.unsqueeze(-1)
        updated = decayed + k.unsqueeze(-1) * delta.unsqueeze(-2)
        out = (updated * q.unsqueeze(-1)).sum(-2)
        state.copy_(updated)
        out = out.to(h.dtype)  # the model casts the recurrence's output to its dtype before the norm
        z = self.z(h).view(batch, self.v_heads, self.v_dim)
        normed = out.float() * torch.rsqrt(out.float().pow(2).mean(-1, keepdim=True) + m.norm.variance_epsilon)
        normed = m.norm.weight.float() * normed.to(h.dtype).float()  # float32, as autocast over float32 weights
        gated = (normed * F.silu(z.float())).to(h.dtype)
        return self.out(gated.reshape(batch, self.v_heads * self.v_dim))


class _AttentionLayer:
    """A gated full-attention layer (Qwen3.5): output gate, partial rotary, zero-centred q/k norms."""

    def __init__(self, module: nn.Module):

        self.module = module
        self.q, self.k, self.v, self.o = (Linear(getattr(module, f"{n}_proj")) for n in "qkvo")
        self.head_dim = module.head_dim
        self.scaling = module.scaling
        self.qkv = None  # q (with its gate), k, v as one GEMM (``fuse``)

    def fuse(self, share: bool) -> None:

        if not any(p.lora for p in (self.q, self.k, self.v)):
            self.qkv = Fused([self.q, self.k, self.v], share)

    def project(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.qkv(h) if self.qkv is not None else (self.q(h), self.k(h), self.v(h))


class HybridDecoderModel:
    """A Qwen3.5 text model's decode step over static KV caches and linear-attention states
    (the interface of ``StaticDecoderModel``)."""

    def __init__(self, model: nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        self.check_architecture(config)
        self.model = model
        self.config = config
        inner = base.model.language_model if hasattr(base.model, "language_model") else base.model
        self.decoder_stack = inner
        self.embed = inner.embed_tokens
        self.final_norm = inner.norm
        self.rotary = inner.rotary_emb

        self.lm_head = Linear(base.lm_head)
        self.layer_types = list(config.layer_types)
        self.blocks = []
        for layer, kind in zip(inner.layers, self.layer_types):
            mixer = _DeltaLayer(layer.linear_attn) if kind == "linear_attention" else _AttentionLayer(layer.self_attn)
            mlp = tuple(Linear(getattr(layer.mlp, f"{n}_proj")) for n in ("gate", "up", "down"))
            self.blocks.append((layer, mixer, mlp))
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.gate_up: dict = {}  # layer index -> fused gate/up projection (``fuse_projections``)
        self.k_cache: dict[int, Tensor] = {}  # full-attention layer -> [B, KV, S, D] slots or a [pages, KV, P, D] pool
        self.v_cache: dict[int, Tensor] = {}
        self.page_size = 0  # 0: one cache row per decode row (slots); else the paged pool's page
        self.cos = self.sin = None

    @staticmethod
    def check_architecture(config) -> None:
        if getattr(config, "model_type", None) not in HYBRID_MODEL_TYPES:
            raise ConfigError(f"HybridDecoderModel decodes Qwen3.5 text models, not {getattr(config, 'model_type', None)!r}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"FastEngine supports SiLU MLPs, not hidden_act={config.hidden_act!r}; use HFEngine")
        if any(kind not in ("linear_attention", "full_attention") for kind in config.layer_types):
            raise ConfigError(f"FastEngine decodes linear- and full-attention layers, not {sorted(set(config.layer_types))}")

    def first_weight_ptr(self) -> int:
        return self.embed.weight.data_ptr()

    def fuse_projections(self, share: bool) -> None:
        """One GEMM for each linear-attention layer's four input projections and for each gate/up
        pair (the Triton path; see ``blocks.Fused`` for ``share``)."""

        for i, (_, mixer, (gate, up, _)) in enumerate(self.blocks):
            mixer.fuse(share)
            if not (gate.lora or up.lora):
                self.gate_up[i] = Fused([gate, up], share)

    def sync(self) -> None:
        """Refresh the fused weight copies from the live parameters."""
        mixers = [m.in_proj if isinstance(m, _DeltaLayer) else m.qkv for _, m, _ in self.blocks]
        fused = [*self.gate_up.values(), *mixers]
        for part in fused:
            if part is not None:
                part.sync()

    def kv_bytes_per_token(self) -> int:
        """K/V bytes of one token position (full-attention layers only: the linear-attention
        layers' states are per sequence)."""
        return self.layer_types.count("full_attention") * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    def decode_bytes(self, attended: int, steps: int) -> None:
        """Not counted: a step also reads and writes every row's linear-attention state, which the
        attended positions do not say (``StaticDecoderModel.decode_bytes``)."""
        return None

    def allocate(self, batch: int, length: int, pages: int = 0, page_size: int = 0) -> None:
        """Linear-attention states for ``batch`` rows; full-attention caches for ``batch`` sequences
        of up to ``length`` tokens, or (``pages`` > 0) a paged pool read through a block table."""
        self.free()
        self.page_size = page_size if pages else 0
        shape = (pages if pages else batch, self.kv_heads, page_size if pages else length, self.head_dim)
        for i, (_, mixer, _) in enumerate(self.blocks):
            if isinstance(mixer, _DeltaLayer):
                mixer.allocate(batch, self.device, self.dtype)
            else:
                self.k_cache[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self.v_cache[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # Text positions are equal on Qwen3.5's three rotary axes, so its multimodal rotary reduces
        # to the plain one over its inverse frequencies (built here: the module's own forward
        # changed its position layout between transformers releases)
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * self.rotary.inv_freq.float().to(self.device)[None, :]
        table = torch.cat([freqs, freqs], dim=-1)
        scale = float(getattr(self.rotary, "attention_scaling", 1.0))
        self.cos = (table.cos() * scale).to(self.dtype)  # [length, rotary_dim]
        self.sin = (table.sin() * scale).to(self.dtype)

    def free(self) -> None:
        self.k_cache, self.v_cache = {}, {}
        self.page_size = 0
        for _, mixer, _ in self.blocks:
            if isinstance(mixer, _DeltaLayer):
                mixer.free()
        self.cos = self.sin = None

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, rows: Tensor,
                placement: tuple[Tensor, Tensor] | None = None) -> Tensor:  # -> [B, V]
        """``prefill_forward``, then ``store_prefill`` into ``rows``: the next-token logits."""
        logits, cache = self.prefill_forward(input_ids, attention_mask)
        self.store_prefill(cache, rows, placement)
        return logits

    @torch.no_grad()
    def prefill_forward(self, input_ids: Tensor, attention_mask: Tensor):  # -> [B, V], its cache
        """The model's own forward over the prompts: the last position's logits and its cache.
        Reads the weights only, so it may run on another stream while decode steps run."""
        hidden, cache = prefill_with_cache(self.decoder_stack, self.config, input_ids, attention_mask)
        last = hidden[:, -1:].contiguous()
        return self.lm_head(last)[:, -1], cache

    def store_prefill(self, cache, rows: Tensor, placement: tuple[Tensor, Tensor] | None = None) -> None:
        """A ``prefill_forward``'s cache into the static buffers' ``rows`` (keys/values into slots
        [0, P), or into a paged pool where ``placement`` puts them; the convolution and recurrent
        states as they end: a row's states are per sequence, so they are overwritten whole on
        admission)."""
        for i, (_, mixer, _) in enumerate(self.blocks):
            if isinstance(mixer, _DeltaLayer):
                conv, recurrent = linear_attention_states(cache, i)
                mixer.conv_state[rows] = conv[..., -mixer.kernel :].to(mixer.conv_state.dtype)
                mixer.state[rows] = recurrent.to(mixer.state.dtype)
            else:
                keys, values = layer_cache(cache, i)
                store_prompt_kv(self.k_cache[i], self.v_cache[i], keys, values, rows, placement)

    def move_rows(self, sources: Tensor) -> None:
        """Compaction: row ``i`` of every cache and linear-attention state becomes row ``sources[i]``'s
        (a paged pool stays put: the block table rows move instead)."""
        if not self.page_size:
            for cache in (*self.k_cache.values(), *self.v_cache.values()):
                cache[: len(sources)] = cache[sources]
        for _, mixer, _ in self.blocks:
            if isinstance(mixer, _DeltaLayer):
                mixer.move_rows(sources)

    def decode(self, token: Tensor, position: Tensor, slot: Tensor, valid: Tensor, kv_len: int, triton: bool,
               table: Tensor | None = None) -> Tensor:
        """One token per sequence (the interface of ``StaticDecoderModel.decode``): full-attention
        layers write K/V at each row's ``slot`` ([B]) and attend to the valid slots below ``kv_len``
        (through ``table`` into a paged pool, if given); linear-attention layers advance their
        states. ``triton``: the recurrence as one Triton kernel (GPU)."""
        batch = token.shape[0]
        # the residual stream in float32 (the embedding and every layer's bf16 output added in
        # float32), as the training forward keeps it under bf16 autocast; each norm's output is
        # rounded to the model dtype for the projections, as autocast rounds their inputs
        x = self.embed.weight[token].float()
        if table is not None:
            table = table[:batch]
        if triton:
            return self._decode_fused(x, position, slot, valid[:batch], table)
        kv_len = min(kv_len, self.cos.shape[0])  # (the Triton engine passes its full length)
        valid = valid[:batch, :kv_len]
        mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(~valid, torch.finfo(self.dtype).min)
        mask = mask[:, None, None, :]
        cos, sin = self.cos[position].unsqueeze(1), self.sin[position].unsqueeze(1)  # [B, 1, rot]
        paged = (table, page_slots(table, slot, self.page_size)) if table is not None else None
        for i, (layer, mixer, (gate, up, down)) in enumerate(self.blocks):
            h = _norm_1p(layer.input_layernorm, x, self.dtype)
            if isinstance(mixer, _DeltaLayer):
                x = x + mixer.step(h)
            else:
                x = x + self._attend(i, mixer, h, cos, sin, slot, mask, kv_len, paged)
            h = _norm_1p(layer.post_attention_layernorm, x, self.dtype)
            x = x + down(F.silu(gate(h)) * up(h))
        return self.lm_head(_norm_1p(self.final_norm, x, self.dtype))

    def _decode_fused(self, x: Tensor, position: Tensor, slot: Tensor, valid: Tensor, table: Tensor | None) -> Tensor:
        """The GPU step: residual adds fused into the norms, a linear-attention layer in two Triton
        kernels, a full-attention layer in one, fused input, q/k/v and gate/up projections."""
        from tandem_lit.rollout.static import kernels

        delta = None
        for i, (layer, mixer, (gate, up, down)) in enumerate(self.blocks):
            norm = layer.input_layernorm
            h = kernels.add_rms_norm(x, delta, norm.weight, norm.eps, one_plus=True, out_dtype=self.dtype)
            if isinstance(mixer, _DeltaLayer):
                delta = mixer.step_fused(h)
            else:
                attention = mixer.module
                delta = mixer.o(kernels.gated_attention(
                    *mixer.project(h), attention.q_norm.weight, attention.k_norm.weight, attention.q_norm.eps,
                    self.cos, self.sin, position, slot, self.k_cache[i], self.v_cache[i], valid,
                    mixer.scaling, self.heads, self.kv_heads, self.head_dim, table=table,
                ))
            norm = layer.post_attention_layernorm
            h = kernels.add_rms_norm(x, delta, norm.weight, norm.eps, one_plus=True, out_dtype=self.dtype)
            gated, upped = self.gate_up[i](h) if i in self.gate_up else (gate(h), up(h))
            delta = down(kernels.silu_mul(gated, upped))
        final = self.final_norm
        return self.lm_head(kernels.add_rms_norm(x, delta, final.weight, final.eps, one_plus=True, out_dtype=self.dtype))

    def _attend(self, i: int, layer: _AttentionLayer, h: Tensor, cos: Tensor, sin: Tensor, slot: Tensor,
                mask: Tensor, kv_len: int, paged: tuple[Tensor, Tensor] | None = None) -> Tensor:
        batch, d = h.shape[0], self.head_dim
        q, gate = layer.q(h).view(batch, self.heads, 2 * d).chunk(2, dim=-1)
        gate = gate.reshape(batch, self.heads * d)
        q = _norm_1p(layer.module.q_norm, q)
        k = _norm_1p(layer.module.k_norm, layer.k(h).view(batch, self.kv_heads, d))
        v = layer.v(h).view(batch, self.kv_heads, d)
        rot = cos.shape[-1]  # rotary on the first `rot` dimensions of each head only
        q = torch.cat([q[..., :rot] * cos + rotate_half(q[..., :rot]) * sin, q[..., rot:]], dim=-1)
        k = torch.cat([k[..., :rot] * cos + rotate_half(k[..., :rot]) * sin, k[..., rot:]], dim=-1)
        if paged is None:
            k_cache, v_cache = self.k_cache[i][:batch], self.v_cache[i][:batch]
            at_slot = slot.view(batch, 1, 1, 1).expand(batch, self.kv_heads, 1, d)  # each row its own slot
            k_cache.scatter_(2, at_slot, k.unsqueeze(2))
            v_cache.scatter_(2, at_slot, v.unsqueeze(2))
            keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
        else:
            table, at_page = paged
            write_pages(self.k_cache[i], at_page, k)
            write_pages(self.v_cache[i], at_page, v)
            keys, values = read_pages(self.k_cache[i], table, kv_len), read_pages(self.v_cache[i], table, kv_len)
        group = self.heads // self.kv_heads
        q = q.view(batch, self.kv_heads, group, d)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * layer.scaling + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        attended = torch.matmul(probs, values).reshape(batch, self.heads * d)
        return layer.o(attended * torch.sigmoid(gate))


def linear_attention_states(cache, index: int) -> tuple[Tensor, Tensor]:
    """(convolution state, recurrent state) of linear-attention layer ``index`` in a Hugging Face
    cache, across the cache layouts of transformers 5.x."""
    if hasattr(cache, "get_conv_state"):
        return cache.get_conv_state(index), cache.get_recurrent_state(index)
    layer = cache.layers[index] if hasattr(cache, "layers") else None
    if layer is not None and hasattr(layer, "conv_states"):
        conv, recurrent = layer.conv_states, layer.recurrent_states
        return (conv[0], recurrent[0]) if isinstance(conv, dict) else (conv, recurrent)
    return cache.conv_states[index], cache.recurrent_states[index]
