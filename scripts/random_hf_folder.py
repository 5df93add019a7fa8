"""Write a random-weight Hugging Face model folder of a shipped config's shape, with a real tokenizer.

What a new user points a shipped config at when the hub weights are not on the machine: a folder
``from_pretrained`` reads like any downloaded model (``config.json``, bf16 ``model.safetensors``,
the tokenizer files with their chat template), so ``tandem-lit fit`` / ``test`` load it through
the same path as real weights (no ``random_init``). Only the weights are random.

    python scripts/random_hf_folder.py --config configs/rlvr/qwen3_4b_tandem.yaml \
        --tokenizer ../shared/models/qwen3-tokenizer --out /tmp/models
    python scripts/random_hf_folder.py --model Qwen/Qwen3-1.7B --tokenizer ... --out /tmp/models
    python scripts/random_hf_folder.py --config ... --tiny ...     # a miniature of the shape (tests)

Each folder's path is printed as ``<role or model>=<folder>`` (one line each), for scripts:

    tandem-lit fit --config configs/rlvr/qwen3_4b_tandem.yaml \
        --model.init_args.senior.init_args.path=<folder> --model.init_args.junior.init_args.path=<folder>

The architectures are ``benchmarks/train_step.py``'s ``SHAPES`` (the hub models' config.json
values that matter), so the benchmark's random models and these folders are the same shapes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.train_step import SHAPES, model_folder  # noqa: E402  (the hub models' shapes, one source)

# Besides tokenizer.json and tokenizer_config.json (which ``model_folder`` copies): the files a
# tokenizer folder may keep its vocabulary, special tokens or chat template in.
TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")

# A miniature of each architecture: the same model type, vocabulary and special tokens (so the
# real tokenizer and chat template work), a few narrow layers (seconds on a CPU).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
TINY_HYBRID = dict(TINY, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, layer_types=None)


class FolderError(Exception):
    """A setting of this script that cannot work (printed as one line)."""


def config_models(config: str) -> dict[str, str]:
    """{role: hub name} of a run config's ``model.init_args`` senior and junior."""
    model = (yaml.safe_load(Path(config).read_text()) or {}).get("model", {}).get("init_args", {})
    roles = {}
    for role in ("senior", "junior"):
        source = model.get(role)
        if source:
            roles[role] = source["path"] if isinstance(source, dict) else str(source)
    if not roles:
        raise FolderError(f"{config} names no model.init_args.senior / junior")
    return roles


def shape_of(hub_name: str, tiny: bool, overrides: dict) -> dict:
    if hub_name not in SHAPES:
        raise FolderError(f"no shape known for {hub_name!r}: one of {', '.join(sorted(SHAPES))}")
    shape = dict(SHAPES[hub_name])
    if tiny:
        shape.update(TINY_HYBRID if shape["model_type"].startswith("qwen3_5") else TINY)
    shape.update({k: v for k, v in overrides.items() if v is not None})
    return {k: v for k, v in shape.items() if v is not None}  # (None: let the config class derive it)


def write_folder(hub_name: str, tokenizer: str | Path, out: str | Path, tiny: bool = False, seed: int = 0,
                 device: str = "cpu", **overrides) -> Path:
    """A folder named after ``hub_name`` under ``out``: its shape's config.json (``overrides``,
    e.g. ``num_hidden_layers``, on top), random bf16 weights as safetensors, and the tokenizer
    folder's files. Returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = Path(tokenizer)
    if not (tokenizer / "tokenizer.json").is_file() or not (tokenizer / "tokenizer_config.json").is_file():
        raise FolderError(f"{tokenizer} is not a tokenizer folder (tokenizer.json and tokenizer_config.json)")
    shape = shape_of(hub_name, tiny, overrides)
    folder = Path(model_folder(hub_name, str(tokenizer), Path(out)))  # config.json + the two tokenizer files
    (folder / "config.json").write_text(json.dumps(shape))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copyfile(tokenizer / name, folder / name)
    config = AutoConfig.from_pretrained(folder)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)  # safetensors; config.json rewritten with the dtype
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", help="a run config: a folder for each model it names (senior, junior)")
    which.add_argument("--model", action="append", help=f"a hub name of a known shape ({', '.join(SHAPES)})")
    parser.add_argument("--tokenizer", default=str(REPO.parent / "shared/models/qwen3-tokenizer"),
                        help="a real tokenizer folder (tokenizer.json, tokenizer_config.json with its chat template)")
    parser.add_argument("--out", required=True, help="folders are written under this one, one per model")
    parser.add_argument("--tiny", action="store_true", help="a miniature of each shape (a few narrow layers)")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers instead of the shape's")
    parser.add_argument("--hidden", type=int, default=None, help="hidden_size instead of the shape's")
    parser.add_argument("--intermediate", type=int, default=None, help="intermediate_size instead of the shape's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: much faster at 4B)")
    args = parser.parse_args(argv)
    models = config_models(args.config) if args.config else {name: name for name in args.model}
    written: dict[str, Path] = {}
    try:
        for role, hub_name in models.items():
            if hub_name not in written:  # a pair of one base (senior and junior) shares a folder
                written[hub_name] = write_folder(hub_name, args.tokenizer, args.out, args.tiny, args.seed, args.device,
                                                 num_hidden_layers=args.layers, hidden_size=args.hidden,
                                                 intermediate_size=args.intermediate)
            print(f"{role}={written[hub_name]}")
    except FolderError as err:
        parser.exit(2, f"random_hf_folder.py: {err}\n")


if __name__ == "__main__":
    main()
