"""Bytes one decoder layer saves for the backward pass, per token, against the memory estimate's
activation model of a Llama block (``tandem_lit.training.memory.ModelShape.activation_bytes_per_token``)
and the weight it gives the layer's type (``HYBRID_LAYER_FACTORS``), on the CPU.

    python dev/benchmarks/activation_bytes.py --models qwen35-9b qwen3-4b --tokens 2048 [--lora 16]

One layer of each type (Qwen3.5: Gated DeltaNet and gated full attention) at the real width,
float32 weights under bf16 autocast as in training, runs forward over ``--tokens`` tokens; every
tensor autograd saves is counted once (by storage), except the weights and their bf16 casts (the
estimate counts weights and the autocast cache apart). Without flash-linear-attention, Qwen3.5's
linear-attention layer runs transformers' torch fallback, as the update does on a GPU where
fla-core cannot be used (dev/log.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

from tandem_lit.training.memory import ModelShape

MODELS = {"qwen35-9b": "Qwen/Qwen3.5-9B", "qwen3-4b": "Qwen/Qwen3-4B-Instruct-2507"}


def config_of(name: str):
    """The real-shape config ``benchmarks/train_step.py`` builds its models from."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from train_step import shape_config

    return shape_config(MODELS[name])


def saved_bytes(layer: nn.Module, *args, **kwargs) -> int:
    """Bytes of the storages autograd saves in ``layer(*args, **kwargs)``, weights and their casts left out."""
    weight_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    weight_shapes = {tuple(p.shape) for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        weight = storage.data_ptr() in weight_storages or (tensor.dim() <= 2 and tuple(tensor.shape) in weight_shapes)
        if not weight:  # a weight, or its bf16 autocast copy (the [batch, tokens, ...] activations have 3+ dims)
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(*args, **kwargs)
    return sum(seen.values())


def measure(name: str, config, tokens: int, lora: int) -> dict[str, float]:
    """Saved bytes per token of one layer of each type, and the Llama-block model's (``estimate``)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        whole = get_peft_model(whole, LoraConfig(r=lora, target_modules="all-linear"))
    shape = ModelShape.of(whole)
    llama_block = ModelShape(**{**vars(shape), "layer_factors": ()})
    estimate = llama_block.activation_bytes_per_token(checkpointing=False, compute_bytes=2) / shape.layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"])
    factors = dict(zip(types, shape.layer_factors))  # what the estimate weights each type by (hybrid models)
    module = __import__(type(whole.get_base_model() if lora else whole).__module__, fromlist=["_"])
    layer_class = next(getattr(module, n) for n in dir(module) if n.endswith("DecoderLayer"))
    rotary_class = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    print(f"{name}: Llama-block model {estimate / 1024:.1f} KiB/token per layer (lora={lora})")
    result = {"estimate": estimate}
    for kind in dict.fromkeys(types):
        index = types.index(kind)
        torch.manual_seed(0)
        layer = layer_class(config, index)
        if lora:
            from peft import LoraConfig, inject_adapter_in_model

            layer.requires_grad_(False)
            layer = inject_adapter_in_model(LoraConfig(r=lora, target_modules="all-linear"), layer)
        hidden = torch.randn(1, tokens, config.hidden_size, requires_grad=True)
        positions = torch.arange(tokens)[None]
        rotary = rotary_class(config)(hidden, positions)
        start = time.perf_counter()
        nbytes = saved_bytes(layer, hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
        result[kind] = nbytes / tokens
        print(f"  {kind:<17} measured {nbytes / tokens / 1024:7.1f} KiB/token = {nbytes / tokens / estimate:.2f}x "
              f"the model; the estimate counts {factors.get(kind, 1.0):.2f}x ({time.perf_counter() - start:.1f} s)")
    return result


def main() -> None:
    from tandem_lit.rollout.logprobs import float32_delta_rule

    float32_delta_rule()  # the update's forward: Qwen3.5's delta rule without autocast (issue 26)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen35-9b", "qwen3-4b"], choices=sorted(MODELS))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on every linear layer (0: full weights)")
    args = parser.parse_args()
    for name in args.models:
        measure(name, config_of(name), args.tokens, args.lora)


if __name__ == "__main__":
    main()
