"""``tandem-lit export``: a run's trained senior as a plain Hugging Face folder.

    tandem-lit export runs/my_run                       # checkpoints/last.ckpt -> runs/my_run/export
    tandem-lit export runs/my_run --ckpt_path runs/my_run/checkpoints/best-step40.ckpt --out senior-hf

The run's own ``config.yaml`` rebuilds the module (the same models, LoRA settings and tokenizer);
the checkpoint's trained tensors are loaded into it; the senior is written the way the rollout
engine sees it (``rollout_named_tensors``: LoRA adapters merged, a 4-bit base dequantised) into a
plain model of its architecture, with the tokenizer and generation config. A checkpoint written by
any number of processes exports the same way (one file of full tensors, or a folder of shards). The folder loads with
``AutoModelForCausalLM.from_pretrained`` and serves as ``senior.path`` / ``junior.path``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.weights import ROLLOUT_DTYPES, build_rollout_copy, load_named_tensors, rollout_named_tensors
from tandem_lit.training.callbacks import check_checkpoint, read_checkpoint


def export_run(build_module: Callable[[Path], object], run_folder: str | Path, ckpt_path: str | Path | None = None,
               out: str | Path | None = None, dtype: str | None = None) -> Path:
    """Write ``run_folder``'s senior, with the weights of ``ckpt_path`` (default: its last.ckpt),
    to ``out`` (default: ``<run_folder>/export``); ``dtype``: the saved weights' (default: as trained).
    ``build_module(config_path)`` builds the run's module from a config file (the command line's
    parser: ``tandem_lit.cli``), so this module does not depend on the command line."""

    run_folder = Path(run_folder)
    config = run_folder / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"{run_folder} has no config.yaml: pass the folder of a tandem-lit fit run")
    ckpt_path = Path(ckpt_path) if ckpt_path else run_folder / "checkpoints" / "last.ckpt"
    check_checkpoint(str(ckpt_path))
    if dtype is not None and dtype not in ROLLOUT_DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(ROLLOUT_DTYPES)}, got {dtype!r}")
    settings = yaml.safe_load(config.read_text())
    for key in ("ckpt_path", "weights_only"):  # the fit subcommand's own keys
        settings.pop(key, None)
    with tempfile.TemporaryDirectory() as tmp:
        resolved = Path(tmp) / "config.yaml"
        resolved.write_text(yaml.safe_dump(settings))
        module = build_module(resolved)
    module.configure_model()
    checkpoint = read_checkpoint(ckpt_path)
    module.on_load_checkpoint(checkpoint)  # names the mismatch if the checkpoint is another model's
    module.load_state_dict(checkpoint["state_dict"], strict=False)
    senior = module.senior
    trained_dtype = next(p.dtype for p in senior.parameters() if p.dtype.is_floating_point)
    plain = build_rollout_copy(senior, ROLLOUT_DTYPES[dtype] if dtype else trained_dtype)
    load_named_tensors(plain, rollout_named_tensors(senior))
    out = Path(out) if out else run_folder / "export"
    plain.save_pretrained(out)
    module.tokenizer.save_pretrained(out)
    return out

