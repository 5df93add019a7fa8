"""scripts/random_hf_folder.py: a random-weight Hugging Face folder of a shipped config's shape that
the real loaders (``load_causal_lm`` / ``load_tokenizer``, no ``random_init``) read like downloaded
weights, with the real tokenizer and its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem_lit.models.loading import ModelSource, load_causal_lm, load_tokenizer
from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]
QWEN3_TOKENIZER = REPO.parent / "shared/models/qwen3-tokenizer"
needs_tokenizer = pytest.mark.skipif(not QWEN3_TOKENIZER.is_dir(), reason="../shared/models/qwen3-tokenizer is not here")


def script():
    return load_script("random_hf_folder")


@needs_tokenizer
def test_a_tiny_folder_of_the_4b_config_loads_through_the_hub_path(tmp_path, capsys):
    from safetensors import safe_open

    script().main(["--config", "configs/rlvr/qwen3_4b_tandem.yaml", "--tiny", "--tokenizer", str(QWEN3_TOKENIZER),
                   "--out", str(tmp_path)])
    lines = dict(line.split("=", 1) for line in capsys.readouterr().out.split())
    assert lines["senior"] == lines["junior"]  # the self-paired 4B run: one base, one folder
    folder = Path(lines["senior"])
    config = json.loads((folder / "config.json").read_text())
    # the shape's architecture and vocabulary, the miniature's layers
    assert (config["model_type"], config["vocab_size"], config["num_hidden_layers"]) == ("qwen3", 151936, 2)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        name = next(iter(f.keys()))
        assert f.get_tensor(name).dtype == torch.bfloat16
    source = ModelSource(path=str(folder), dtype="float32")  # as the config's senior: float32 master weights
    model = load_causal_lm(source)
    again = load_causal_lm(source)  # the saved weights, not a fresh random draw
    assert next(model.parameters()).dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    tokenizer = load_tokenizer(source)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], 151936)


def test_overrides_and_refusals(tmp_path):
    module = script()
    tokenizer = REPO / "configs/tiny/senior"  # any tokenizer folder
    folder = module.write_folder("Qwen/Qwen3-1.7B", tokenizer, tmp_path, tiny=True, num_hidden_layers=3, hidden_size=32)
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (3, 32, 2)
    assert load_causal_lm(ModelSource(path=str(folder), dtype="bfloat16")).config.num_hidden_layers == 3
    with pytest.raises(module.FolderError, match="no shape known for 'org/unknown'"):
        module.write_folder("org/unknown", tokenizer, tmp_path)
    with pytest.raises(module.FolderError, match="is not a tokenizer folder"):
        module.write_folder("Qwen/Qwen3-1.7B", tmp_path, tmp_path, tiny=True)


def test_a_model_folder_without_a_tokenizer_is_one_line(tmp_path, capsys):
    """transformers builds an empty tokenizer (one token) from such a folder: refused, not run."""
    from tandem_lit.cli import main

    folder = script().write_folder("Qwen/Qwen3-1.7B", REPO / "configs/tiny/senior", tmp_path, tiny=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
                   "--model.init_args.senior.path", str(folder), "--model.init_args.senior.random_init", "false"])
    assert code.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tandem-lit: error")]
    assert len(lines) == 1 and "has no tokenizer" in lines[0] and str(folder) in lines[0]


def test_the_gpu_stage_script_parses_and_refuses_an_unknown_card(tmp_path):
    """scripts/gpu_mainjob.sh (its stages ran end to end on the CPU with TINY=1 when it was written:
    a minute and a half, too slow for the suite)."""
    import subprocess

    script_path = REPO / "scripts/gpu_mainjob.sh"
    assert subprocess.run(["bash", "-n", str(script_path)]).returncode == 0
    assert subprocess.run(["bash", "-n", str(REPO / "dev/gpu_call.sh")]).returncode == 0  # (dev/gpu_session.md)
    refused = subprocess.run(["bash", str(script_path), "fit"], env={"OUT": str(tmp_path), "CARD": "a100", "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "CARD must be h200 or h100" in refused.stdout
