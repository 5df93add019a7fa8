"""Shared fixtures: the repository root, character tokenizers and tiny real Llama models.

Models are ordinary ``transformers`` models built from small configs with random weights, so
every test runs the same code paths a hub model would, on CPU, in milliseconds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tandem_lit.models.tiny import char_tokenizer, tiny_llama_config

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """``scripts/<name>.py`` as a module, loaded once (the scripts are not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


# Few characters, so that a random model writes spaces, full stops, line breaks and end tokens
# often: handoff boundaries and finished rollouts show up within a couple of dozen tokens.
SMALL_ALPHABET = "abcde .\n"

torch.set_num_threads(1)  # the CI machine is small and shared; tiny models gain nothing from threads


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are reported skipped where no CUDA device is present: one rule for
    every GPU test, so ``python -m pytest -m gpu`` on a GPU machine runs exactly them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (run `python -m pytest -m gpu` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root (configs name tiny models and data relative to it), with an
    argv of our own: LightningCLI must not see pytest's arguments. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("in_repo")``."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr("sys.argv", ["tandem-lit"])


def tiny_tandem_module(**settings):
    """A TandemModule over the tiny random senior and junior configs (word handoff p = 0.5,
    senior-only evaluation, no start evaluation, no completions log); ``settings`` add to or
    replace these defaults (verifier, objective, sampling and optimizer at least)."""
    from tandem_lit.models import ModelSource
    from tandem_lit.rollout import WordHandoff
    from tandem_lit.training.module import TandemModule

    defaults = dict(
        senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32"),
        junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="float32"),
        handoff=WordHandoff(p=0.5),
        eval_modes=["senior"],
        evaluate_at_start=False,
        completions_every_n_steps=0,
    )
    return TandemModule(**grouped_settings(**{**defaults, **settings}))


# TandemModule's settings groups and the flat names tests use for their fields
SETTINGS_GROUPS = {
    "rollout": {"sampling": "sampling", "rollout_batch_size": "batch_size", "max_prompt_tokens": "max_prompt_tokens",
                "dynamic_sampling": "dynamic_sampling", "partial": "partial", "prompt_format": "prompt_format",
                "junior_prompt_format": "junior_prompt_format", "authorship_z": "authorship_z"},
    "update": {name: name for name in ("mini_batch_size", "micro_batch_size", "max_grad_norm", "overlong", "max_idle_steps",
                                       "allow_low_precision_weights", "logp_gap_warning", "logp_gap_limit")},
    "evaluation": {"eval_sampling": "sampling", "eval_modes": "modes", "eval_handoff": "handoff", "evaluate_at_start": "at_start",
                   "test_handoff": "test_handoff", "test_sampling": "test_sampling", "test_forced_token": "test_forced_token",
                   "pass_k": "pass_k"},
    "logging": {name: name for name in ("jargon_pattern", "language", "completions_every_n_steps", "completions_per_log")},
}


def grouped_settings(**flat):
    """TandemModule keyword arguments from flat setting names (``sampling=...``, ``eval_modes=...``):
    each flat name goes into its settings group (``rollout=RolloutSettings(sampling=...)``)."""
    from tandem_lit.training import settings as groups

    classes = {"rollout": groups.RolloutSettings, "update": groups.UpdateSettings,
               "evaluation": groups.EvaluationSettings, "logging": groups.LoggingSettings}
    out = {name: value for name, value in flat.items() if not any(name in fields for fields in SETTINGS_GROUPS.values())}
    for group, fields in SETTINGS_GROUPS.items():
        values = {field: flat[name] for name, field in fields.items() if name in flat and flat[name] is not None}
        if values:
            out[group] = classes[group](**values)
    return out


@pytest.fixture(scope="session")
def char_tok():
    """The full printable-ASCII character tokenizer the tiny configs use (100 tokens)."""
    return char_tokenizer()


@pytest.fixture(scope="session")
def small_tok():
    """A character tokenizer over SMALL_ALPHABET (12 tokens: 4 special + 8 characters)."""
    return char_tokenizer(SMALL_ALPHABET)


def tiny_llama(vocab_size: int, seed: int, init_range: float = 0.5, **config_overrides):
    """A random tiny LlamaForCausalLM in eval mode. A wide init makes greedy text varied."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size, **config_overrides)
    config.initializer_range = init_range
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


@pytest.fixture(scope="session")
def small_model(small_tok):
    """Tiny Llama over ``small_tok`` whose greedy text has spaces, stops and end tokens."""
    return tiny_llama(len(small_tok), seed=0)


@pytest.fixture(scope="session")
def other_small_model(small_tok):
    """A second, different tiny Llama over the same tokenizer (a real junior)."""
    return tiny_llama(len(small_tok), seed=1, hidden=32, layers=1, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def machine_can_sandbox():
    """Skip a module of sandbox tests on a machine without user namespaces (e.g. a non-root CI
    runner on Ubuntu 24.04); any other refusal of the sandbox is a failure."""
    from tandem_lit.verifiers.sandbox import Sandbox, SandboxUnavailableError

    try:
        Sandbox().check()
    except SandboxUnavailableError as err:
        if err.protection != "namespaces":
            raise
        pytest.skip(str(err))


def flat_settings(init_args: dict) -> dict:
    """A resolved TandemModule ``init_args`` with its settings groups flattened back to the flat
    names ``grouped_settings`` takes (``rollout.sampling`` -> ``sampling``, ``evaluation.sampling``
    -> ``eval_sampling``), so config tests read the paper's numbers by their familiar names."""
    flat = {name: value for name, value in init_args.items() if name not in SETTINGS_GROUPS}
    for group, fields in SETTINGS_GROUPS.items():
        values = init_args.get(group) or {}
        for name, field in fields.items():
            if field in values:
                flat[name] = values[field]
    return flat


def ragged_rollout(vocab: int, prompts=(3, 1, 4), completions=(9, 1, 5), seed: int = 0):
    """A Rollout of random tokens with left-padded prompts and completions of different lengths
    (``prompts[i]`` and ``completions[i]`` real tokens in row i), every token the senior's: what
    an update pass sees, without an engine."""
    from tandem_lit.rollout.record import Author, Rollout

    generator = torch.Generator().manual_seed(seed)
    n, width = len(prompts), max(completions)
    prompt_mask = torch.zeros(n, max(prompts), dtype=torch.long)
    author = torch.full((n, width), int(Author.PAD), dtype=torch.int8)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt_mask[i, max(prompts) - p :] = 1
        author[i, :c] = Author.SENIOR
    prompt_ids = torch.randint(4, vocab, prompt_mask.shape, generator=generator) * prompt_mask
    completion_ids = torch.randint(4, vocab, (n, width), generator=generator) * (author != Author.PAD)
    return Rollout(prompt_ids, prompt_mask, completion_ids, author, torch.ones(n, dtype=torch.bool),
                   torch.zeros(n, dtype=torch.bool), *(torch.zeros(n, dtype=torch.long),) * 3, texts=[""] * n)


def teacher_forced(model, rollout, temperature: float = 1.0):  # -> [B, T] each written token's log-prob, [B, T] the best
    """The model itself (a plain forward over prompt and response) scoring a rollout's tokens at
    ``temperature``: what an engine's recorded log-probs are checked against."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    width = rollout.completion_ids.shape[1]
    logp = (logits[:, -width - 1 : -1].float() / temperature).log_softmax(-1)
    return logp.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1), logp.max(-1).values
