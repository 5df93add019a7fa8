"""The demo's senior and junior: tiny Llama models trained in-process, cached by recipe.

``demo://senior`` and ``demo://junior`` (model paths in ``configs/demo.yaml``) resolve to
folders under the cache that load like any hub model (``demo://<recipe>/<role>`` picks a recipe of
``RECIPES`` by name; ``standard`` is the default). The first use builds both models (a few minutes on a
laptop CPU); later uses load them from the cache. The cache key is a hash of the recipe, so
changing any number in it builds anew; a build is reproducible from the recipe's seed.

    cache root   $TANDEM_LIT_CACHE, else $XDG_CACHE_HOME/tandem-lit, else ~/.cache/tandem-lit
    models       <cache root>/demo/<recipe>-<hash>/{senior,junior}/ + recipe.json, report.json

The recipe follows the Tandem Training skill-gap setting in miniature:

* junior: a smaller model trained only on plain solutions (a weaker partner that never saw jargon);
* senior: a larger model trained first on plain solutions (what a pretrained LM brings), then on
  solutions that wrap ~99% of calculations in jargon, where 80% of the examples start with a
  prefix of the solution in a random style that the loss skips.

Both see lists of bare calculations mixed into their solutions (``facts_share``): from whole
solutions alone a model this small learns to copy the question's numbers long before it knows its
sums and products. The senior thus writes jargon when
  left alone and continues in the style of its context, as a pretrained LM fine-tuned on GSM8K's
  calculator annotations does. A senior trained on jargon alone cannot write plain text at all,
  and tandem RL then destroys its accuracy instead of its jargon.

The ``language`` recipe (``demo://language/senior``, ``demo://language/junior``; configs/demo_language.yaml)
is the language-gap setting in miniature, with ``LanguagePhase`` phases:

* junior: the same small model, trained only on French solutions (``tandem_lit.data.world``);
* senior: the same larger model, trained first on English solutions, then on solutions that are
  English 75% of the time, where 80% of the examples start with a loss-free prefix in a random
  language, continued in that language: it writes mostly English when left alone and continues
  French in French, as a pretrained LM that knows French but answers in English does. With 99%
  English it writes French worse, and its accuracy dipped below the junior's while tandem RL moved
  it to French (docs/demo.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem_lit.data.world import (
    LANGUAGES,
    STYLES,
    VOCABULARY,
    Language,
    Problem,
    language_continuation,
    language_prefix,
    problems,
    styled_continuation,
)
from tandem_lit.errors import ConfigError
from tandem_lit.training.sft import SFTConfig, SFTExample, run_sft

SCHEME = "demo://"
ROLES = ("senior", "junior")


@dataclass(frozen=True)
class Shape:
    """Llama architecture of one model (character vocabulary, tied embeddings)."""

    hidden: int
    layers: int
    heads: int = 4
    kv_heads: int = 2


@dataclass(frozen=True)
class Phase:
    """One supervised phase: ``plain`` (prompt -> plain solution), ``jargon`` (prompt -> solution
    in jargon with probability ``jargon_share``; ``prefix_share`` of the examples start with a
    loss-free prefix of the solution in a random style, continued in that style) or ``facts``
    (lists of ``facts_per_example`` calculations, no prompt). In ``plain`` and ``jargon`` phases,
    ``facts_share`` of the examples are such fact lists: a tiny model learns the arithmetic from
    dense lists many times faster than from whole solutions, and from the solutions it learns to
    copy the question's numbers into them; mixing keeps both while neither is forgotten."""

    data: str
    steps: int
    lr: float
    batch_size: int = 16
    jargon_share: float = 0.99
    prefix_share: float = 0.5
    warmup_steps: int = 50
    facts_per_example: int = 8
    facts_share: float = 0.0


@dataclass(frozen=True)
class LanguagePhase:
    """One supervised phase of the language-gap recipe: prompt -> solution in ``language`` with
    probability ``language_share`` (else in the other language); ``prefix_share`` of the examples
    start with a loss-free prefix of the solution in a random language, cut after its first word of
    that language, continued in that language; ``facts_share`` as in ``Phase``."""

    language: Language
    steps: int
    lr: float
    batch_size: int = 16
    language_share: float = 1.0
    prefix_share: float = 0.0
    warmup_steps: int = 50
    facts_per_example: int = 8
    facts_share: float = 0.0


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the demo models; its hash is the cache key."""

    seed: int = 0
    train_problems: int = 20_000
    junior: Shape = Shape(hidden=64, layers=2)
    # The junior's accuracy climbs steeply with its steps (1,000: 31%, 1,250: 62%, 1,500: 88% on
    # this world): 1,250 puts it where the paper's junior is, clearly below the senior's ~90%.
    junior_phases: tuple[Phase | LanguagePhase, ...] = (Phase("plain", steps=1250, lr=3e-3, facts_share=0.15),)
    senior: Shape = Shape(hidden=96, layers=4)
    senior_phases: tuple[Phase | LanguagePhase, ...] = (
        Phase("plain", steps=800, lr=3e-3, facts_share=0.35),
        Phase("jargon", steps=700, lr=2e-3, prefix_share=0.8, facts_share=0.35),
    )
    report_problems: int = 200  # held-out problems for the build report
    max_new_tokens: int = 100
    format_version: int = 1  # bump when the builder's code changes what a recipe produces

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    @property
    def language_gap(self) -> bool:
        """A language-gap recipe (``LanguagePhase`` phases), reported by language, not jargon."""
        return any(isinstance(p, LanguagePhase) for p in (*self.junior_phases, *self.senior_phases))


RECIPES: dict[str, Recipe] = {
    "standard": Recipe(),
    # Same shapes, world and step counts as the standard pair; languages instead of jargon.
    "language": Recipe(
        junior_phases=(LanguagePhase("fr", steps=1250, lr=3e-3, facts_share=0.15),),
        senior_phases=(
            LanguagePhase("en", steps=800, lr=3e-3, facts_share=0.35),
            LanguagePhase("en", steps=700, lr=2e-3, language_share=0.75, prefix_share=0.8, facts_share=0.35),
        ),
    ),
}


def cache_root() -> Path:
    if os.environ.get("TANDEM_LIT_CACHE"):
        return Path(os.environ["TANDEM_LIT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "tandem-lit"


def parse_name(name: str) -> tuple[str, str]:
    """``senior`` -> (standard, senior); ``standard/junior`` -> (standard, junior)."""
    recipe, _, role = name.rpartition("/")
    recipe = recipe or "standard"
    if role not in ROLES or recipe not in RECIPES:
        raise ConfigError(
            f"unknown demo model {SCHEME}{name}: use {SCHEME}<role> or {SCHEME}<recipe>/<role> with role in "
            f"{list(ROLES)} and recipe in {sorted(RECIPES)}"
        )
    return recipe, role


def demo_model_dir(name: str) -> Path:
    """Folder of a demo model (``senior``, ``junior``, ``standard/senior``), built if missing."""
    recipe_name, role = parse_name(name)
    return ensure_built(recipe_name) / role


def ensure_built(recipe_name: str) -> Path:
    """The cache folder of a recipe's models, building it first if absent (atomically: a crash or a
    concurrent build never leaves a half-written folder under the final name)."""
    recipe = RECIPES[recipe_name]
    final = cache_root() / "demo" / f"{recipe_name}-{recipe.digest()}"
    if (final / "report.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = final.parent / f".{final.name}.{os.getpid()}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"tandem-lit: building the demo models (recipe '{recipe_name}', once; cached in {final})", file=sys.stderr, flush=True)
    try:
        build(recipe, scratch)
        try:
            os.rename(scratch, final)
        except OSError:  # another process finished first: keep its models
            if not (final / "report.json").exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------ building


def phase_examples(phase: Phase | LanguagePhase, pool: list[Problem], rng: random.Random) -> list[SFTExample]:
    """``steps x batch_size`` fresh examples of one phase, drawn from the problem pool."""
    out = []
    for _ in range(phase.steps * phase.batch_size):
        if isinstance(phase, LanguagePhase):
            out.append(language_example(phase, pool, rng))
            continue
        if phase.data == "facts" or rng.random() < phase.facts_share:
            calcs = [rng.choice(rng.choice(pool).calcs) for _ in range(phase.facts_per_example)]
            out.append(SFTExample("", " ".join(c.render("plain") for c in calcs)))
            continue
        problem = rng.choice(pool)
        if phase.data == "plain":
            out.append(SFTExample(problem.prompt, problem.solution("plain")))
            continue
        if rng.random() < phase.prefix_share:
            prefix, rest = styled_continuation(problem, rng, rng.choice(STYLES))
            out.append(SFTExample(problem.prompt + prefix, rest))
        else:
            style = "jargon" if rng.random() < phase.jargon_share else "plain"
            out.append(SFTExample(problem.prompt, problem.solution(style)))
    return out


def language_example(phase: LanguagePhase, pool: list[Problem], rng: random.Random) -> SFTExample:
    if rng.random() < phase.facts_share:
        calcs = [rng.choice(rng.choice(pool).calcs) for _ in range(phase.facts_per_example)]
        return SFTExample("", " ".join(c.render("plain") for c in calcs))
    problem = rng.choice(pool)
    if rng.random() < phase.prefix_share:
        prefix, rest = language_continuation(problem, rng, rng.choice(LANGUAGES))
        return SFTExample(problem.prompt + prefix, rest)
    other = next(code for code in LANGUAGES if code != phase.language)
    language = phase.language if rng.random() < phase.language_share else other
    return SFTExample(problem.prompt, problem.solution(language=language))


def train_model(shape: Shape, phases: tuple[Phase | LanguagePhase, ...], pool: list[Problem], seed: int, tokenizer, label: str):
    from transformers import LlamaForCausalLM

    from tandem_lit.models.tiny import tiny_llama_config

    config = tiny_llama_config(len(tokenizer), hidden=shape.hidden, layers=shape.layers, heads=shape.heads, kv_heads=shape.kv_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    for index, phase in enumerate(phases):
        if isinstance(phase, LanguagePhase):
            if phase.language not in LANGUAGES:
                raise ConfigError(f"phase language must be one of {list(LANGUAGES)}, got {phase.language!r}")
        elif phase.data not in ("facts", "plain", "jargon"):
            raise ConfigError(f"phase data must be 'facts', 'plain' or 'jargon', got {phase.data!r}")
        rng = random.Random(f"{seed}/{label}/{index}")
        examples = phase_examples(phase, pool, rng)
        sft = SFTConfig(
            steps=phase.steps, batch_size=phase.batch_size, lr=phase.lr, warmup_steps=phase.warmup_steps,
            seed=seed + index, log_every=100,
        )
        kind = phase.language if isinstance(phase, LanguagePhase) else phase.data
        run_sft(model, tokenizer, examples, sft, label=f"{label} {index + 1}/{len(phases)} ({kind})")
    return model, config


def build(recipe: Recipe, folder: Path) -> dict:
    """Train both models into ``folder`` (``senior/``, ``junior/``, ``recipe.json``, ``report.json``)."""
    from tandem_lit.models.tiny import char_tokenizer, write_model_dir

    started = time.perf_counter()
    tokenizer = char_tokenizer()
    pool = problems(recipe.seed, recipe.train_problems, "train")
    report: dict = {"recipe": asdict(recipe), "seconds": {}}
    models = {}
    for role, shape, phases, offset in (
        ("junior", recipe.junior, recipe.junior_phases, 1),
        ("senior", recipe.senior, recipe.senior_phases, 2),
    ):
        t = time.perf_counter()
        model, config = train_model(shape, phases, pool, recipe.seed * 100 + offset, tokenizer, role)
        with quiet_transformers():
            write_model_dir(folder / role, config, tokenizer, model)
        models[role] = model
        report["seconds"][role] = round(time.perf_counter() - t, 1)
        report[f"{role}_parameters"] = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    evaluate = evaluate_languages if recipe.language_gap else evaluate_models
    report["eval"] = evaluate(models["senior"], models["junior"], tokenizer, recipe)
    report["seconds"]["report"] = round(time.perf_counter() - t, 1)
    report["seconds"]["total"] = round(time.perf_counter() - started, 1)
    (folder / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2))
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    print(f"tandem-lit: demo models built in {report['seconds']['total']:.0f} s: {json.dumps(report['eval'])}", file=sys.stderr, flush=True)
    return report


@contextlib.contextmanager
def quiet_transformers():
    """No "Writing model shards" progress bar in the build log."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------- the report


def greedy(model, tokenizer, contexts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of ``model`` alone, through the rollout engine the RL run uses."""
    from tandem_lit.rollout.engine import HFEngine
    from tandem_lit.rollout.handoff import SoloHandoff
    from tandem_lit.rollout.record import PromptBatch
    from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds

    engine = HFEngine()
    engine.setup(model, None, tokenizer)
    encoded = tokenizer(contexts, padding=True, padding_side="left", return_tensors="pt")
    batch = PromptBatch(encoded["input_ids"], encoded["attention_mask"], sequence_seeds(0, 0, len(contexts)))
    rollout = engine.generate(batch, SoloHandoff("senior"), SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens))
    return rollout.texts


def held_out_report(senior, junior, tokenizer, recipe: Recipe, measure: str, measured: Callable[[list[str]], float],
                    prefixes: dict[str, Callable[[Problem], str]]) -> dict[str, float]:
    """Greedy accuracy and ``measure`` of each model on held-out problems, and how each continues
    a correct half-solution (``prefixes``: cut after the first calculation of two-step problems)."""
    from tandem_lit.verifiers.numeric import GSM8KVerifier

    verifier = GSM8KVerifier()
    held = problems(recipe.seed, recipe.report_problems, "held_out")
    two_step = [p for p in held if len(p.calcs) == 2]
    out: dict[str, float] = {}

    def score(texts: list[str], rows: list[Problem]) -> float:
        return sum(verifier.grade(t, answer=p.answer).correct for t, p in zip(texts, rows)) / len(rows)

    for role, model in (("senior", senior), ("junior", junior)):
        texts = greedy(model, tokenizer, [p.prompt for p in held], recipe.max_new_tokens)
        out[f"{role}_accuracy"] = score(texts, held)
        out[f"{role}_{measure}"] = measured(texts)
        for variant, prefix in prefixes.items():
            cut = [prefix(p) for p in two_step]
            rest = greedy(model, tokenizer, [p.prompt + x for p, x in zip(two_step, cut)], recipe.max_new_tokens)
            out[f"{role}_after_{variant}_accuracy"] = score([x + r for x, r in zip(cut, rest)], two_step)
            out[f"{role}_after_{variant}_{measure}"] = measured(rest)
    return {k: round(v, 3) for k, v in out.items()}


def evaluate_models(senior, junior, tokenizer, recipe: Recipe) -> dict[str, float]:
    """The jargon pair: accuracy and jargon rate, alone and after a half-solution in either style."""
    from tandem_lit.evaluation.metrics import JargonDetector

    prefixes = {style: (lambda p, style=style: p.solution(style)[: p.first_calc_end(style)]) for style in STYLES}
    return held_out_report(senior, junior, tokenizer, recipe, "jargon_rate", JargonDetector().rate, prefixes)


def language_share(language: Language = "fr"):
    """The share of ``language`` in the demo world's solutions (``WordListLanguageShare`` over
    ``VOCABULARY``: configs/demo_language.yaml names the same lists)."""
    from tandem_lit.evaluation.language import WordListLanguageShare

    return WordListLanguageShare(language, {code: list(listed) for code, listed in VOCABULARY.items()})


def evaluate_languages(senior, junior, tokenizer, recipe: Recipe) -> dict[str, float]:
    """The language pair: accuracy and French share, alone and after a half-solution in either
    language (the language gap the tandem run exists for is ``junior_after_en_accuracy``)."""
    french = language_share("fr")
    prefixes = {language: (lambda p, language=language: language_prefix(p, language)) for language in LANGUAGES}
    return held_out_report(senior, junior, tokenizer, recipe, "fr_share", lambda texts: french.rate(texts) or 0.0, prefixes)


def main(argv: list[str] | None = None) -> None:
    """``python -m tandem_lit.demo [recipe]``: build (or find) the models, print the report."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", nargs="?", default="standard", choices=sorted(RECIPES))
    folder = ensure_built(parser.parse_args(argv).recipe)
    print(folder)
    print((folder / "report.json").read_text())


if __name__ == "__main__":
    main()

