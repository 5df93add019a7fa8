"""Supervised fine-tuning from the command line: `tandem-lit fit` with SFTModel and SFT rows, on
the tiny local models. The loss is the prompt-masked one, the saved Hugging Face folder is the
trained model (LoRA merged) and runs as a tandem senior, and a resume continues exactly."""

from __future__ import annotations

import json
import os
import signal

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml

from tandem_lit.cli import build_cli, main

JARGON = "configs/paper_a/sft_jargon_llama2.yaml"
TINY = "{path: configs/tiny/senior, random_init: true, init_seed: 1, dtype: float32}"
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.logger", "false"]
# the paper's config on CPU: the tiny senior for Llama-2-7b, plain LoRA for QLoRA, the repository's GSM8K sample
JARGON_ON_CPU = [
    "--model.init_args.model", TINY, "--model.init_args.lora.load_in_4bit", "false",
    "--model.init_args.hf_dtype", "float32", "--trainer.accelerator", "cpu", "--trainer.precision", "32",
    "--data.init_args.source", "data/gsm8k-sample", "--data.init_args.val_size", "4", "--data.init_args.batch_size", "2",
    "--data.init_args.eval_batch_size", "4", "--data.init_args.train_limit", "6", "--model.init_args.warmup_steps", "0",
    "--model.init_args.optimizer.init_args.lr", "1e-2",
]

pytestmark = [
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings("ignore:No seed found"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory"),
]


def history(root) -> list[dict]:
    return [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]


def train_losses(root) -> list[float]:
    return [row["train/loss"] for row in history(root) if "train/loss" in row]


def sft_config(tmp_path, rows: list[dict], steps: int, batch_size: int = 2) -> str:
    """A tiny SFT config over ``rows`` (a JSONL the user supplies): full weights of the tiny senior."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "trainer": {"default_root_dir": str(tmp_path / "run"), "max_steps": steps, "accelerator": "cpu"},
        "model": {"class_path": "SFTModel", "init_args": {
            "model": yaml.safe_load(TINY),
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3}},
        }},
        "data": {"class_path": "SFTDataModule", "init_args": {"source": str(data), "batch_size": batch_size}},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


# A French junior's rows, as a user supplies them (ASCII: the tiny tokenizer has no accents).
# Targets of different lengths: a mean over rows is not the mean over tokens.
FRENCH = [{"prompt": f"Question: {a} + {b}?\nAnswer:", "target": f" {a} + {b} = {a + b}." + " Oui." * i + f" La reponse est {a + b}."}
          for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 5), (6, 1), (4, 4), (7, 2), (5, 3), (8, 1)])]


def test_fit_memorises_its_rows_with_the_loss_on_target_tokens_only(tmp_path):
    from tandem_lit.data.sft_data import SFTDataModule
    from tandem_lit.models import ModelSource, load_causal_lm, load_tokenizer

    config = sft_config(tmp_path, FRENCH, steps=40)
    main(args=["fit", "--config", config, *QUIET])
    root = tmp_path / "run"
    losses = train_losses(root)
    assert len(losses) == 40
    assert sum(losses[-4:]) / 4 < 0.3 * sum(losses[:4]) / 4, losses

    # Step 1's loss, by hand: the untrained model, the first batch of two rows, the mean
    # cross-entropy over the tokens of the targets and end tokens (not over the prompts).
    (first,) = [row for row in history(root) if row["step"] == 1]
    rows = next(iter(SFTDataModule(source=str(tmp_path / "rows.jsonl"), batch_size=2).train_dataloader())).rows
    source = ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32")
    model, tok = load_causal_lm(source).eval(), load_tokenizer(source)
    per_token, per_row = [], []
    for row in rows:
        prompt = tok(row["prompt"])["input_ids"]
        ids = tok(row["prompt"] + row["target"])["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        row_ce = [F.cross_entropy(logits[t - 1], torch.tensor(ids[t])).item() for t in range(len(prompt), len(ids))]
        per_token += row_ce
        per_row.append(sum(row_ce) / len(row_ce))
    assert first["train/target_tokens"] == len(per_token)
    assert first["train/loss"] == pytest.approx(sum(per_token) / len(per_token), rel=1e-5)
    assert first["train/loss"] != pytest.approx(sum(per_row) / len(per_row), rel=1e-5)  # tokens, not rows, average
    assert (root / "hf" / "model.safetensors").exists()


def test_the_saved_folder_is_the_trained_model_and_a_tandem_senior(tmp_path):
    from transformers import AutoModelForCausalLM

    from tandem_lit.models import ModelSource, load_causal_lm

    root = tmp_path / "sft"
    cli = build_cli(["fit", "--config", JARGON, *JARGON_ON_CPU, *QUIET, "--trainer.default_root_dir", str(root),
                     "--trainer.max_steps", "3", "--model.init_args.hf_every_n_steps", "2"])
    folder = root / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert (root / "hf-step2" / "model.safetensors").exists() and not (root / "hf-step3").exists()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    trained = cli.model.model.eval()  # the peft model: base weights + trained adapters
    assert type(trained).__name__.startswith("Peft")
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    base = load_causal_lm(ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32")).eval()
    ids = cli.model.encode([{"prompt": "Question: 48/2?\nAnswer:", "target": " 48/2 = <<48/2=24>>24\n#### 24"}])["input_ids"]
    with torch.no_grad():
        want, got, untrained = trained(input_ids=ids).logits, saved(input_ids=ids).logits, base(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - untrained).abs().max() > 1e-3, "the adapters trained and were merged"

    tandem = tmp_path / "tandem"
    main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--model.init_args.senior", f"{{path: {folder}, dtype: float32}}",
               "--trainer.default_root_dir", str(tandem), "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
               "--model.init_args.evaluation.at_start", "false", "--data.init_args.batch_size", "2",
               "--model.init_args.rollout.sampling.n", "2", "--model.init_args.rollout.sampling.max_new_tokens", "8", *QUIET])
    assert [row["step"] for row in history(tandem) if "train/loss" in row] == [1]
    assert yaml.safe_load((tandem / "config.yaml").read_text())["model"]["init_args"]["senior"]["path"] == str(folder)


class SignalAtStep(L.Callback):
    """Sends SIGINT (a user's Ctrl-C) to this process when training batch ``step`` begins."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_a_resume_from_last_ckpt_continues_exactly(tmp_path):
    """Stopped after update 3 (the end of the first epoch of 3 batches), resumed to 5: the same
    batches, dropout masks, losses and weights as a run that was never stopped."""
    def fit(root, *extra):
        main(args=["fit", "--config", JARGON, *JARGON_ON_CPU, *QUIET, "--trainer.default_root_dir", str(root),
                   "--trainer.max_steps", "5", *extra])

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    fit(straight)
    callback = json.dumps([{"class_path": "test_sft_cli.SignalAtStep", "init_args": {"step": 2}}])
    with pytest.raises(SystemExit) as info:
        fit(stopped, "--trainer.callbacks", callback)
    assert info.value.code == 128 + signal.SIGINT
    assert len(train_losses(stopped)) == 3 and not (stopped / "hf").exists()
    fit(stopped, "--ckpt_path", str(stopped / "checkpoints" / "last.ckpt"))
    assert train_losses(stopped) == train_losses(straight)
    assert len(set(train_losses(straight))) == 5
    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=False)
    assert any("lora_A" in k for k in a["state_dict"]) and a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert (stopped / "hf" / "model.safetensors").exists()


def one_line_error(capsys, args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args=args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("tandem-lit: error:")]
    assert "Traceback" not in err
    return line


def test_rows_without_the_target_field_are_a_one_line_error(tmp_path, capsys):
    rows = [{"prompt": r["prompt"], "answer": r["target"]} for r in FRENCH]
    line = one_line_error(capsys, ["fit", "--config", sft_config(tmp_path, rows, steps=1), *QUIET])
    assert "row 0 has no field 'target'" in line and "target_template" in line


def test_qlora_without_bitsandbytes_is_a_one_line_error(tmp_path, capsys):
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed")
    except ImportError:
        pass
    line = one_line_error(capsys, ["fit", "--config", JARGON, "--model.init_args.model", TINY, "--trainer.accelerator", "cpu",
                                   "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET])
    assert "lora.load_in_4bit" in line and "needs bitsandbytes" in line and "pip install" in line


def test_gsm8k_solutions_are_the_tandem_prompts_with_or_without_jargon():
    from tandem_lit.data import GSM8KDataModule
    from tandem_lit.data.sft_data import GSM8KSolutionsDataModule

    rl = GSM8KDataModule(source="data/gsm8k-sample", val_size=8)
    jargon = GSM8KSolutionsDataModule(source="data/gsm8k-sample", val_size=8)
    plain = GSM8KSolutionsDataModule(source="data/gsm8k-sample", val_size=8, annotations=False)
    for split in ("train", "val"):
        assert [r["prompt"] for r in jargon.rows(split)] == [r["prompt"] for r in rl.rows(split)]
        assert [r["target"] for r in jargon.rows(split)] == [" " + r["solution"] for r in rl.rows(split)]
    first = jargon.rows("train")[0]["target"]
    assert "<<48/2=24>>" in first and first.endswith("#### 72")
    assert plain.rows("train")[0]["target"] == first.replace("<<48/2=24>>", "").replace("<<48+24=72>>", "")
    assert not any("<<" in r["target"] for r in plain.rows("train"))


def test_a_gsm8k_solution_without_its_final_answer_is_refused(tmp_path):
    import json

    from tandem_lit.data.sft_data import GSM8KSolutionsDataModule
    from tandem_lit.errors import DataError

    rows = [{"question": f"q{i}", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(4)]
    rows[2]["answer"] = "3+1=4, no final line"
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="####.*no final line"):
        GSM8KSolutionsDataModule(source=str(tmp_path), val_size=0).rows("train")


def test_the_context_is_formatted_as_the_tandem_module_formats_prompts():
    from conftest import tiny_tandem_module
    from transformers import AutoTokenizer

    from tandem_lit.models import ModelSource
    from tandem_lit.objectives import GRPO
    from tandem_lit.training.settings import PromptFormat
    from tandem_lit.training.sft import SFTModel
    from tandem_lit.verifiers import GSM8KVerifier

    tok = AutoTokenizer.from_pretrained("configs/tiny/senior")
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    for fmt in (PromptFormat(), PromptFormat(system_prompt="Be brief."), PromptFormat(chat_template=False),
                PromptFormat(template="{prompt}\nReponds en francais.", chat_template=False)):
        rl = tiny_tandem_module(verifier=GSM8KVerifier(), objective=GRPO(), prompt_format=fmt)
        sft = SFTModel(ModelSource("configs/tiny/senior"), prompt_format=fmt)
        rl.rollouts.tokenizer = sft.tokenizer = tok
        prompt = "Question: 2+3?\nAnswer:"
        assert sft.format_context(prompt) == rl.rollouts.format_prompt(prompt)
        context = rl.rollouts.encode_prompts([prompt], padding=False)["input_ids"][0]
        ids = sft.encode([{"prompt": prompt, "target": " 5"}])["input_ids"][0].tolist()
        assert ids == context + tok(" 5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
