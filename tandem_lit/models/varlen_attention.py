"""Packed update passes through flash attention's variable-length kernel, with nothing beyond PyTorch.

transformers keeps packed sequences apart by position ids restarting at 0: under ``sdpa`` it builds
a block-diagonal [L, L] mask, which takes scaled-dot-product attention off its flash kernel (the packed
update was slower than padded rows for it: dev/log.md), and finding the restarts reads a device value back (a sync per forward). PyTorch's own
``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) runs the flash kernel over sequences
given by cumulative lengths, which the update knows on the host.

``VARLEN`` is an attention function registered in transformers' ``AttentionInterface``. While the
update runs (``varlen_during``), a senior whose attention is ``sdpa`` runs it instead: a forward
that passes ``cu_seq_lens_q`` (the packed passes: ``rollout.logprobs.packed_hidden_states``) goes
through the variable-length kernel on CUDA, through a loop of causal SDPA calls, one per sequence,
elsewhere (the CPU's reference: the same result); any other forward through plain causal SDPA. No
mask function is registered for it, so transformers builds none: the update never needs one
(padded rows are laid out left-aligned, ``completion_hidden_states``; packed rows carry their
boundaries in ``cu_seq_lens_q``). Outside the update the senior is ``sdpa`` again, with its masks,
for generation with padded prompts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

VARLEN = "tandem_varlen"


def varlen_kernel():
    """PyTorch's variable-length flash attention, or None (torch < 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _kernel_parameters() -> frozenset[str]:
    """The varlen kernel's keyword names (they changed between torch releases), read once: every
    attention layer of every packed pass asks."""
    return frozenset(inspect.signature(varlen_kernel()).parameters)


def available(device: torch.device) -> bool:
    """Whether packed passes on ``device`` can run ``VARLEN`` (CUDA: PyTorch's varlen kernel; the CPU: its loop)."""
    return device.type == "cpu" or (device.type == "cuda" and varlen_kernel() is not None)


def _cuda_varlen(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, longest: int, scaling: float) -> Tensor:
    """[T, H, D] queries, [T, KV, D] keys and values -> [T, H, D], causal within each sequence."""
    kernel, params = varlen_kernel(), _kernel_parameters()
    kwargs = {}
    if "window_size" in params:  # torch >= 2.12: causal is window (-1, 0)
        kwargs["window_size"] = (-1, 0)
    else:  # torch 2.10 / 2.11
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scaling
    elif abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
        query = query * (scaling * query.shape[-1] ** 0.5)  # the kernel's own scale is 1 / sqrt(D)
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # an older kernel wants as many key/value heads as query heads
            key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for x in (key, value))
    return kernel(query, key, value, cu, cu, longest, longest, **kwargs)


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_dtype(query: Tensor) -> torch.dtype | None:
    """The dtype the flash kernel should see ``query`` in, or None where it cannot run it.

    Under autocast the rotary embedding hands attention float32 queries (its cos/sin follow the
    float32 residual stream); SDPA is on autocast's low-precision list and casts them, a custom op
    like ``varlen_attn`` is not, so the cast is made here, to autocast's dtype. Float32 without
    autocast has no flash kernel."""
    if query.dtype in FLASH_DTYPES:
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        return dtype if dtype in FLASH_DTYPES else None
    return None


@functools.cache
def _log_float32_once() -> None:
    log.warning("packed attention in float32 without autocast has no flash kernel: "
                "one causal SDPA call per sequence instead (same result, slower)")


def _reference_varlen(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scaling: float) -> Tensor:
    """The same as ``_cuda_varlen`` as one causal SDPA call per sequence (the CPU's path)."""
    bounds = cu.tolist()
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [H, L, D]
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                  enable_gqa=k.shape[0] != q.shape[0]).transpose(0, 1))
    return torch.cat(out) if out else query.new_zeros(query.shape[:-1] + value.shape[-1:])


def varlen_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention interface: query [B, H, L, D], key/value [B, KV, L, D] -> ([B, L, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # not a packed pass: rows with no mask, causal (transformers built none)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("packed sequences must come as one row with no attention mask")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, heads, D]
    dtype = flash_dtype(q) if q.is_cuda else None
    if dtype is not None:
        q, k, v = (x.to(dtype) for x in (q, k, v))
        out = _cuda_varlen(q, k, v, cu, int(kwargs["max_length_q"]), scaling)
    else:
        if q.is_cuda:
            _log_float32_once()
        out = _reference_varlen(q, k, v, cu, scaling)
    return out.unsqueeze(0), None


@functools.cache
def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)


def uses_varlen(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == VARLEN


@contextlib.contextmanager
def varlen_during(models: list[nn.Module], device: torch.device) -> Iterator[None]:
    """Inside: each of ``models`` (their ``config``) whose attention is ``sdpa`` runs ``VARLEN``
    (where ``available``); afterwards ``sdpa`` again."""
    switched = [m for m in models if getattr(m.config, "_attn_implementation", None) == "sdpa"] if available(device) else []
    if switched:
        register()
    for model in switched:
        model.config._attn_implementation = VARLEN
    try:
        yield
    finally:
        for model in switched:
            model.config._attn_implementation = "sdpa"
