"""Building blocks both static decoders use (plain Llama-family and Qwen3.5 hybrid).

Linear layers read from the live parameters (LoRA adapters included), fused projections, the
transformers-order RMSNorm and rotary helpers, and the prefill through a model's own decoder stack
whose Hugging Face cache the decoders copy into their static buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem_lit.errors import ConfigError


class Linear:
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


class Fused:
    """Projections of one input as one GEMM over one concatenated weight.

    Reading q/k/v (and gate/up) as one matrix is markedly faster at decode batch sizes than three
    (two) thin products. With ``share`` (the engine's own rollout copy) the parts' parameters
    become views of the fused tensor, so loading weights into them fills it: no second copy, no
    sync. Otherwise (trained weights decoded in place) the fused tensor is a copy that ``sync()``
    refreshes at the start of every rollout batch, so it never lags the policy. Only for
    projections without LoRA.
    """

    def __init__(self, parts: list[Linear], share: bool = False):
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
    def _bias(part: Linear) -> Tensor:
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


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # the same op order as transformers' LlamaRMSNorm / Qwen3RMSNorm
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def norm(module: nn.Module, x: Tensor) -> Tensor:
    return rms_norm(x, module.weight, eps_of(module))


def eps_of(norm: nn.Module) -> float:
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


def layer_cache(cache, index: int) -> tuple[Tensor, Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        layer = cache.layers[index]
        return layer.keys, layer.values
    return cache.key_cache[index], cache.value_cache[index]


# ------------------------------------------------------------------ paged KV pools (torch path)
# A pool is [pages, kv_heads, page_size, head_dim] per layer: the slot layout [rows, kv_heads,
# positions, head_dim] with positions cut into pages, so one head's page is contiguous, as a row's
# positions are in a slot cache. A row of the block table maps a sequence's logical page to a
# pool page (``paging.py``); a position is a flat index page * page_size + offset. Page 0 is
# scratch: rows without a sequence, or past their own pages, write there.


def page_slots(table: Tensor, slot: Tensor, page_size: int) -> Tensor:  # [B, P] int, [B] -> [B] long
    """Each row's new-token position, as a flat pool position."""
    page = table.gather(1, (slot // page_size).unsqueeze(1)).squeeze(1).long()
    return page * page_size + slot % page_size


FP8_CACHE = torch.float8_e4m3fn  # FastEngine(kv_cache_dtype="fp8"): keys and values in 8 bits, scale 1


def to_cache(x: Tensor, cache: Tensor) -> Tensor:
    """Keys or values in ``cache``'s dtype. An 8-bit cache holds +-448 at most (e4m3, no
    infinity): larger entries are clamped there rather than turned into NaN."""
    if cache.dtype == FP8_CACHE:
        limit = torch.finfo(FP8_CACHE).max
        return x.clamp(-limit, limit).to(FP8_CACHE)
    return x.to(cache.dtype)


def bits(cache: Tensor) -> Tensor:
    """An 8-bit cache as its bytes (torch's scatter and indexing kernels take no float8 on every
    device; moving bytes is the same); any other cache as it is."""
    return cache.view(torch.uint8) if cache.dtype == FP8_CACHE else cache


def pages_to_host(pool: Tensor, pages: Tensor) -> Tensor:  # -> [n, KV, page_size, D] on the host
    """Pool ``pages`` [n] copied to host memory (pinned when the pool is on a GPU, so the copy does
    not wait: a later copy back on the same stream is ordered after it)."""
    gathered = bits(pool)[pages]
    host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=gathered.is_cuda)
    host.copy_(gathered, non_blocking=True)
    return host.view(pool.dtype)


def pages_from_host(pool: Tensor, pages: Tensor, host: Tensor) -> None:
    """``pages_to_host``'s copy back into pool ``pages`` (other pages, possibly, than it came from)."""
    if host.dtype != pool.dtype or host.shape[1:] != pool.shape[1:]:
        raise ValueError(f"kept pages of {host.dtype} {tuple(host.shape[1:])} cannot go back into a pool of "
                         f"{pool.dtype} {tuple(pool.shape[1:])} pages (kv_cache_dtype or kv_page_size changed)")
    bits(pool)[pages] = bits(host).to(pool.device, non_blocking=True)


def write_pages(pool: Tensor, positions: Tensor, values: Tensor) -> None:
    """values [N, KV, D] at flat pool positions [N] (rows past their pages all write the scratch page)."""
    page_size = pool.shape[2]
    bits(pool)[positions // page_size, :, positions % page_size] = bits(to_cache(values, pool))


def read_pages(pool: Tensor, table: Tensor, kv_len: int) -> Tensor:  # -> [B, KV, kv_len, D]
    """Positions [0, kv_len) of every row, gathered through its table row."""
    kv_heads, page_size, head_dim = pool.shape[1:]
    pages = table[:, : -(-kv_len // page_size)].long()  # [B, n]
    gathered = bits(pool)[pages].view(pool.dtype).transpose(1, 2)  # [B, KV, n, page_size, D]
    return gathered.reshape(table.shape[0], kv_heads, -1, head_dim)[:, :, :kv_len]


def store_prompt_kv(k_cache: Tensor, v_cache: Tensor, keys: Tensor, values: Tensor, rows: Tensor,
                    placement: tuple[Tensor, Tensor] | None) -> None:
    """One layer's prefilled keys and values [B, KV, W, D]: into cache ``rows`` at slots [0, W),
    or, in a paged pool, where ``placement`` puts them (``write_prompt_pages``)."""
    if placement is not None:
        write_prompt_pages(k_cache, keys, placement)
        write_prompt_pages(v_cache, values, placement)
        return
    width = keys.shape[2]
    bits(k_cache)[rows, :, :width] = bits(to_cache(keys, k_cache))
    bits(v_cache)[rows, :, :width] = bits(to_cache(values, v_cache))


def write_prompt_pages(pool: Tensor, keys: Tensor, placement: tuple[Tensor, Tensor]) -> None:
    """Prefilled keys (or values) [B, KV, W, D] into the pool: ``placement`` = (source: flat
    indices into the B x W prompt positions, dest: flat pool positions), one pair per kept token."""
    source, dest = placement
    flat = keys.transpose(1, 2).reshape(-1, keys.shape[1], keys.shape[3])  # [B * W, KV, D]
    write_pages(pool, dest, flat.index_select(0, source))
