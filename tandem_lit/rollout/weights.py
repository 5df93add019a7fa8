"""Rollout weights: the engine's own copy of the senior, in the rollout dtype.

What the optimiser owns (float32 master weights, LoRA adapters over a frozen or 4-bit base,
later FSDP shards) is not what a decoder should read: a float32 senior decodes at a fifth of the
bf16 speed, and LoRA adds two thin products to every projection. So an engine decodes from a
plain Hugging Face model of the senior's architecture in the rollout dtype, filled through one
seam, ``RolloutEngine.load_weights(named_tensors)``: an iterable of (parameter name, tensor) in
the plain model's names, the shape vLLM's ``load_weights`` and verl's weight sync take.

``rollout_named_tensors`` is the producer for a model in this process (cast, LoRA merged, 4-bit
dequantised, one tensor at a time so nothing is materialised twice). A senior sharded by FSDP2
feeds the same seam from inside ``gathered`` (its shards all-gathered once per rollout phase).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from tandem_lit.errors import ConfigError, WeightSyncError

ROLLOUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def is_sharded(model: nn.Module | None) -> bool:
    return model is not None and any(isinstance(m, FSDPModule) for m in model.modules())


def unwrapped_class(model: nn.Module) -> type:
    """The model's own class (``fully_shard`` swaps in a subclass ``FSDP<Class>``)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)) if isinstance(model, FSDPModule) else type(model)


@contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Every FSDP unit of ``model`` all-gathered (plain tensors in its modules) for the block; a
    collective: every rank enters it at the same point. Resharded on exit."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in reversed(units):
            unit.reshard()


def plain_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def has_adapters(model: nn.Module) -> bool:
    return any(_is_lora_layer(m) for m in plain_model(model).modules())


def _base_weight(layer: nn.Module) -> Tensor:
    weight = layer.weight
    if weight.dtype.is_floating_point:
        return weight.detach()
    from peft.utils.integrations import dequantize_module_weight  # a 4-bit/8-bit base (QLoRA)

    return dequantize_module_weight(layer).detach()


def _merged_weight(layer: nn.Module) -> Tensor:
    """W + sum of the active adapters' deltas (float32 accumulation)."""
    weight = _base_weight(layer.base_layer)
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return weight
    merged = weight.float()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            merged = merged + layer.get_delta_weight(adapter).detach().float()
    return merged


@torch.no_grad()
def rollout_named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The trained model as a plain model's (name, tensor) pairs: LoRA adapters merged into their
    base weights, 4-bit bases dequantised, tied weights once. Lazy: one merged tensor at a time."""
    base = plain_model(model)
    adapted: list[str] = []
    for name, module in base.named_modules():
        if _is_lora_layer(module):
            adapted.append(name + ".")
            yield f"{name}.weight", _merged_weight(module)
            if getattr(module.base_layer, "bias", None) is not None:
                yield f"{name}.bias", module.base_layer.bias.detach()
    for name, param in base.named_parameters():
        if not any(name.startswith(prefix) for prefix in adapted):
            yield name, param.detach()


def check_rollout_dtype(requested: str) -> str:
    if requested not in ("auto", "live", *ROLLOUT_DTYPES):
        raise ConfigError(f"rollout_dtype must be 'auto', 'live' or one of {sorted(ROLLOUT_DTYPES)}, got {requested!r}")
    return requested


def rollout_dtype(requested: str, model: nn.Module) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that has it, else the weights' own dtype."""
    if check_rollout_dtype(requested) != "auto":
        return ROLLOUT_DTYPES[requested]
    param = next(plain_model(model).parameters())
    if param.is_cuda and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return param.dtype if param.dtype.is_floating_point else torch.float32


def needs_copy(model: nn.Module, dtype: torch.dtype) -> bool:
    """A copy pays off when the decode weights would differ from the trained ones."""
    params = list(plain_model(model).parameters())
    return has_adapters(model) or any(p.dtype != dtype for p in params if p.dtype.is_floating_point) or any(
        not p.dtype.is_floating_point for p in params
    )


def keeps_float32(model: nn.Module, name: str) -> bool:
    """Parameters a low-precision rollout copy keeps in float32: in models with linear-attention
    layers (Qwen3.5), the decay gates' ``A_log`` and ``dt_bias`` and every norm's weight. The
    training forward reads them in float32 under bf16 autocast (they enter no matmul); a bf16
    ``A_log`` alone moves every decay rate by up to 0.8% and a 4-layer model's log-probs by 0.02
    nats (dev/benchmarks/logp_gap.py). A few thousand numbers per layer."""
    if "linear_attention" not in (getattr(plain_model(model).config, "layer_types", None) or []):
        return False
    leaf = name.rsplit(".", 2)
    return leaf[-1] in ("A_log", "dt_bias") or (leaf[-1] == "weight" and len(leaf) > 1 and leaf[-2].endswith("norm"))


@torch.no_grad()
def build_rollout_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """An empty plain model of ``model``'s architecture in ``dtype`` on its device, frozen.

    Built directly on the device (random init there is fast; no second host copy); the caller
    fills it with ``load_named_tensors``. Buffers (rotary tables) are copied from the source.
    """
    base = plain_model(model)
    device = next(base.parameters()).device
    with torch.device(device):
        copy = unwrapped_class(base)._from_config(base.config, dtype=dtype)
    for name, param in copy.named_parameters():
        if keeps_float32(copy, name):
            param.data = param.data.float()
    sources = dict(base.named_buffers())
    for name, buffer in copy.named_buffers():
        if name in sources and sources[name].shape == buffer.shape:
            buffer.copy_(sources[name])
    copy.generation_config = base.generation_config
    copy.eval().requires_grad_(False)
    return copy


@torch.no_grad()
def expected_parameter(params: dict[str, Tensor], name: str, tensor: Tensor, where: str) -> Tensor:
    """``params[name]``, refusing (WeightSyncError) a name ``where`` lacks or a shape it does not have."""
    param = params.get(name)
    if param is None:
        raise WeightSyncError(
            f"weight sync: {name!r} is not a parameter of {where}; "
            "the producer and the engine disagree on the architecture or the names"
        )
    if param.shape != tensor.shape:
        raise WeightSyncError(f"weight sync: {name!r} has shape {tuple(tensor.shape)}, {where}'s {tuple(param.shape)}")
    return param


def load_named_tensors(target: nn.Module, named: Iterable[tuple[str, Tensor]]) -> int:
    """Copy every (name, tensor) into ``target``'s parameter of that name (cast to its dtype and
    device); the names must cover ``target``'s parameters exactly. Returns the tensors loaded."""
    params = dict(target.named_parameters())
    loaded: set[str] = set()
    for name, tensor in named:
        param = expected_parameter(params, name, tensor, f"the rollout model ({type(target).__name__})")
        param.copy_(tensor)
        loaded.add(name)
    missing = sorted(params.keys() - loaded)
    if missing:
        raise WeightSyncError(f"weight sync left {len(missing)} rollout parameters unset (e.g. {missing[:3]})")
    return len(loaded)
