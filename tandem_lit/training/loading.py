"""The models of a tandem run, loaded for training: the senior as it trains (full weights, LoRA or
QLoRA adapters, activation checkpointing, FSDP2 shards), the frozen junior, a frozen reference
copy of the senior for a KL term on full weights, and both tokenizers."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

from tandem_lit.models import (
    LoraSettings,
    ModelSource,
    apply_lora,
    freeze,
    load_causal_lm,
    load_tokenizer,
    quantization_config,
)
from tandem_lit.training import preflight


@dataclass
class RunModels:
    senior: nn.Module
    junior: nn.Module | None
    reference: nn.Module | None  # None: no KL term, or LoRA (the senior with its adapters disabled)
    tokenizer: Any
    junior_tokenizer: Any


def load_run_models(senior_source: ModelSource, junior_source: ModelSource | None, lora: LoraSettings | None,
                    allow_low_precision: bool, checkpointing: bool, uses_reference: bool, mesh=None,
                    bf16_compute: bool = False) -> RunModels:
    """Load the run's models; ``mesh``: FSDP2's device mesh when the trainer shards the senior
    (the reference copy is taken before sharding)."""
    tokenizer = load_tokenizer(senior_source)
    senior = load_causal_lm(senior_source, quantization_config(lora))
    if lora is None:
        preflight.check_weight_precision(senior, allow_low_precision)
    else:
        senior = apply_lora(senior, lora)
    if checkpointing:
        senior.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    junior = junior_tokenizer = None
    if junior_source is not None:
        junior, junior_tokenizer = freeze(load_causal_lm(junior_source)), load_tokenizer(junior_source)
    reference = freeze(copy.deepcopy(senior)) if uses_reference and lora is None else None
    if mesh is not None:
        from tandem_lit.training.distributed import shard_model

        senior = shard_model(senior, mesh["data_parallel"], bf16_compute=bf16_compute)
    return RunModels(senior, junior, reference, tokenizer, junior_tokenizer)
