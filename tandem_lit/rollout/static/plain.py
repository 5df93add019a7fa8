"""The plain decoder: one Llama-family model's decode step over a static KV cache (Llama,
Mistral, Qwen2, Qwen3), a small reimplementation of the block that reads the parameters of the
model it is given."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.static.blocks import (
    FP8_CACHE,
    Fused,
    Linear,
    bits,
    eps_of,
    layer_cache,
    norm,
    page_slots,
    pages_from_host,
    pages_to_host,
    prefill_with_cache,
    read_pages,
    rotate_half,
    store_prompt_kv,
    to_cache,
    write_pages,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # and Qwen3.5's hybrid attention: hybrid.py
_POSITION_ONLY_ROPE = ("default", "linear", "llama3", "yarn", None)


def longest_first(slot: Tensor) -> Tensor:  # [B] -> [B] long
    """The rows by descending ``slot``, ties in row order: ``torch.argsort(slot, descending=True,
    stable=True)``, computed by counting (each row's rank is the rows ahead of it) so that the decode
    step's CUDA graph captures only elementwise ops and reductions, no sort."""
    rows = torch.arange(slot.shape[0], device=slot.device)
    ahead = (slot[None, :] > slot[:, None]) | ((slot[None, :] == slot[:, None]) & (rows[None, :] < rows[:, None]))
    return torch.empty_like(rows).scatter_(0, ahead.sum(1), rows)


class _Layer:
    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = (Linear(getattr(attn, f"{n}_proj")) for n in "qkvo")
        self.gate, self.up, self.down = Linear(mlp.gate_proj), Linear(mlp.up_proj), Linear(mlp.down_proj)
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3
        self.k_norm = getattr(attn, "k_norm", None)
        self.qkv: Fused | None = None
        self.gate_up: Fused | None = None

    def fuse(self, share: bool) -> None:
        if not (self.q.lora or self.k.lora or self.v.lora):
            self.qkv = Fused([self.q, self.k, self.v], share)
        if not (self.gate.lora or self.up.lora):
            self.gate_up = Fused([self.gate, self.up], share)

    def sync(self) -> None:
        for fused in (self.qkv, self.gate_up):
            if fused is not None:
                fused.sync()

    def project_qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.qkv(h) if self.qkv is not None else (self.q(h), self.k(h), self.v(h))

    def mlp_inputs(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.gate_up(h) if self.gate_up is not None else (self.gate(h), self.up(h))


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
        self.lm_head = Linear(base.lm_head)
        self.rotary = inner.rotary_emb
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.cache_dtype = self.dtype  # the KV caches' (FastEngine's kv_cache_dtype: fp8 sets 8 bits)
        self.split_positions: int | None = None  # the Triton attention's chunks (FastEngine's attention_split)
        self.programs_longest_first = True  # the attention programs longest row first (FastEngine's attention_order)
        self.k_cache: list[Tensor] = []  # per layer: [B, KV, S, D] slots, or a [pages, KV, page_size, D] pool
        self.v_cache: list[Tensor] = []
        self.page_size = 0  # 0: one cache row per decode row (slots); else the paged pool's page
        self.cos = self.sin = None

    @property
    def f16_products(self) -> bool:
        """An 8-bit cache under a 16-bit model: the Triton attention widens it to float16 for its
        products (one conversion per pair of entries on a GPU; the bf16 widening made the kernel
        slower than over a bf16 cache, docs/performance.md). A float32 model keeps float32 products."""
        return self.cache_dtype == FP8_CACHE and self.dtype in (torch.bfloat16, torch.float16)

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

    def kv_bytes_per_token(self) -> int:
        return len(self.layers) * 2 * self.kv_heads * self.head_dim * self.cache_dtype.itemsize

    def decode_bytes(self, attended: int, steps: int) -> int:
        """Bytes ``steps`` decode steps read whose attention read ``attended`` cache positions in all:
        those positions' keys and values, and every weight once a step (the embedding table only
        where it is the LM head too: a step looks up one row of it per sequence)."""
        params = {id(p): p for p in self.model.parameters()}.values()
        weights = sum(p.numel() * p.element_size() for p in params)
        if self.embed.weight is not self.lm_head.weight:
            weights -= self.embed.weight.numel() * self.embed.weight.element_size()
        return attended * self.kv_bytes_per_token() + steps * weights

    def allocate(self, batch: int, length: int, pages: int = 0, page_size: int = 0) -> None:
        """Static caches for ``batch`` sequences of up to ``length`` tokens (``pages`` > 0: a paged
        pool of that many pages instead, read through a block table), and the rotary table."""
        if self.sliding_window is not None and length > self.sliding_window:
            raise ConfigError(
                f"sequences of {length} tokens exceed the model's sliding window ({self.sliding_window}); "
                "FastEngine attends to the full context: use HFEngine"
            )
        self.free()  # the old caches go before the new ones are allocated
        self.page_size = page_size if pages else 0
        shape = (pages if pages else batch, self.kv_heads, page_size if pages else length, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in self.layers]
        probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        cos, sin = self.rotary(probe, positions)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [length, head_dim]

    def free(self) -> None:
        self.k_cache, self.v_cache = [], []
        self.page_size = 0
        self.cos = self.sin = None

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor, rows: Tensor,
                placement: tuple[Tensor, Tensor] | None = None) -> Tensor:  # -> [B, V]
        """``prefill_forward``, then ``store_prefill`` into cache ``rows``: the next-token logits."""
        logits, cache = self.prefill_forward(input_ids, attention_mask)
        self.store_prefill(cache, rows, placement)
        return logits

    @torch.no_grad()
    def prefill_forward(self, input_ids: Tensor, attention_mask: Tensor):  # -> [B, V], its cache
        """The model's own decoder stack over the prompts (left-padded among themselves), then its
        LM head on the last position. Reads the weights only, so it may run on another stream
        while decode steps run (``FastEngine(overlap_prefill="on")``)."""
        hidden, cache = prefill_with_cache(self.decoder_stack, self.config, input_ids, attention_mask)
        last = hidden[:, -1:]  # what ``logits_to_keep=1`` hands the LM head (bit-equal to HFEngine on CPU)
        if last.is_cuda:
            # on that strided view cuBLAS picks a kernel far slower than on a contiguous copy
            # (dev/benchmarks/prefill.py, dev/log.md)
            last = last.contiguous()
        return self.lm_head(last)[:, -1], cache

    def store_prefill(self, cache, rows: Tensor, placement: tuple[Tensor, Tensor] | None = None) -> None:
        """A ``prefill_forward``'s keys/values into cache ``rows`` at slots [0, P), or, in a paged
        pool, where ``placement`` puts them (``blocks.write_prompt_pages``)."""
        for i in range(len(self.layers)):
            keys, values = layer_cache(cache, i)
            store_prompt_kv(self.k_cache[i], self.v_cache[i], keys, values, rows, placement)

    def save_pages(self, pages: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Paged pool ``pages`` [n] of every layer as host copies: (keys, values), per layer
        [n, KV, page_size, D] (a paused sequence's cache, kept over a training update)."""
        return [pages_to_host(c, pages) for c in self.k_cache], [pages_to_host(c, pages) for c in self.v_cache]

    def load_pages(self, keys: list[Tensor], values: list[Tensor], pages: Tensor) -> None:
        """``save_pages``' copies back into pool ``pages``."""
        for pool, host in zip((*self.k_cache, *self.v_cache), (*keys, *values)):
            pages_from_host(pool, pages, host)

    def move_rows(self, sources: Tensor) -> None:
        """Compaction: cache row ``i`` becomes row ``sources[i]``'s, for i < len(sources) (a paged
        pool stays put: the block table rows move instead)."""
        if self.page_size:
            return
        for cache in (*self.k_cache, *self.v_cache):
            bits(cache)[: len(sources)] = bits(cache)[sources]

    def decode(self, token: Tensor, position: Tensor, slot: Tensor, valid: Tensor, kv_len: int, triton: bool,
               table: Tensor | None = None) -> Tensor:
        """One token per sequence: write its K/V at its own ``slot``, attend to the valid slots up to it.

        token, position, slot: [B] long (each row its own cache slot: rows admitted at different
        steps sit at different depths); valid: [Bcap, S] bool -> logits [B, V]. The torch path
        attends to slots [0, kv_len); the Triton path reads each row's bound from ``slot``. With a
        paged pool, ``table`` [Bcap, S / page_size] int32 maps each row's slots to pool pages.
        """
        if triton:
            return self._decode_triton(token, position, slot, valid, table)
        batch = token.shape[0]
        valid = valid[:batch, :kv_len]
        x = self.embed.weight[token]  # [B, H]
        cos = self.cos[position].unsqueeze(1)  # [B, 1, D]
        sin = self.sin[position].unsqueeze(1)
        mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(~valid, torch.finfo(self.dtype).min)
        mask = mask[:, None, None, :]  # [B, 1, 1, kv_len]
        group = self.heads // self.kv_heads
        at_slot = slot.view(batch, 1, 1, 1).expand(batch, self.kv_heads, 1, self.head_dim)
        if table is not None:
            table = table[:batch]
            at_page = page_slots(table, slot, self.page_size)
        for i, layer in enumerate(self.layers):
            h = norm(layer.input_norm, x)
            q = layer.q(h).view(batch, self.heads, self.head_dim)
            k = layer.k(h).view(batch, self.kv_heads, self.head_dim)
            v = layer.v(h).view(batch, self.kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q, k = norm(layer.q_norm, q), norm(layer.k_norm, k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if table is None:
                k_cache, v_cache = self.k_cache[i][:batch], self.v_cache[i][:batch]
                bits(k_cache).scatter_(2, at_slot, bits(to_cache(k, k_cache)).unsqueeze(2))
                bits(v_cache).scatter_(2, at_slot, bits(to_cache(v, v_cache)).unsqueeze(2))
                keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]  # [B, KV, S, D]
            else:
                write_pages(self.k_cache[i], at_page, k)
                write_pages(self.v_cache[i], at_page, v)
                keys, values = read_pages(self.k_cache[i], table, kv_len), read_pages(self.v_cache[i], table, kv_len)
            keys, values = keys.to(self.dtype), values.to(self.dtype)  # (an 8-bit cache's entries, widened)
            q = q.view(batch, self.kv_heads, group, self.head_dim)
            scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scaling + mask  # [B, KV, G, S]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            attended = torch.matmul(probs, values).reshape(batch, self.heads * self.head_dim)
            x = x + layer.o(attended)
            h = norm(layer.post_norm, x)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        return self.lm_head(norm(self.final_norm, x))

    def _decode_triton(self, token: Tensor, position: Tensor, slot: Tensor, valid: Tensor, table: Tensor | None) -> Tensor:
        from tandem_lit.rollout.static import kernels

        x = self.embed.weight[token]  # [B, H], the residual stream (updated in place)
        delta = None
        # the attention programs start longest row first: at 128 rows not all of them are resident at
        # once, and a long row that started last would set each layer's end (docs/performance.md,
        # "The decode-attention kernel alone")
        order = longest_first(slot) if self.programs_longest_first else None
        for i, layer in enumerate(self.layers):
            h = kernels.add_rms_norm(x, delta, layer.input_norm.weight, eps_of(layer.input_norm))
            attended = kernels.rope_attention(
                *layer.project_qkv(h),
                layer.q_norm.weight if layer.q_norm is not None else None,
                layer.k_norm.weight if layer.k_norm is not None else None,
                eps_of(layer.q_norm) if layer.q_norm is not None else 0.0,
                self.cos, self.sin, position, slot, self.k_cache[i], self.v_cache[i], valid,
                self.scaling, self.heads, self.kv_heads, self.head_dim, table=table,
                split_positions=self.split_positions, f16_dot=self.f16_products, order=order,
            )
            delta = layer.o(attended)
            h = kernels.add_rms_norm(x, delta, layer.post_norm.weight, eps_of(layer.post_norm))
            delta = layer.down(kernels.silu_mul(*layer.mlp_inputs(h)))
        return self.lm_head(kernels.add_rms_norm(x, delta, self.final_norm.weight, eps_of(self.final_norm)))
