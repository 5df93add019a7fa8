"""Models: where they come from (hub names, local folders, registered schemes such as
``demo://``), loading, LoRA/QLoRA, freezing; and tiny models built from configs for tests."""

from tandem_lit.models.loading import (
    DTYPES,
    LoraSettings,
    ModelSource,
    apply_lora,
    freeze,
    gguf_package_dir,
    load_causal_lm,
    load_tokenizer,
    quantization_config,
    quantized_copy,
    quantized_device_map,
    register_resolver,
    resolve,
)

__all__ = [
    "DTYPES", "LoraSettings", "ModelSource", "apply_lora", "freeze", "gguf_package_dir", "load_causal_lm",
    "load_tokenizer", "quantization_config", "quantized_copy", "quantized_device_map", "register_resolver", "resolve",
]
