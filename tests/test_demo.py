"""The offline demo: the synthetic world, the model cache, and a shortened demo end to end."""

from __future__ import annotations

import json
import random
import re

import pytest

from tandem_lit.data.world import (
    LANGUAGES,
    NAMES,
    STYLES,
    TEMPLATES,
    VOCABULARY,
    cut_points,
    is_held_out,
    language_continuation,
    language_prefix,
    problems,
    styled_continuation,
    words,
)
from tandem_lit.demo import build as demo_build
from tandem_lit.evaluation.metrics import JargonDetector
from tandem_lit.verifiers.numeric import GSM8KVerifier

JARGON = re.compile(r"<<([^<>\n]*)>>")
CALCULATION = re.compile(r"\d+[-+*]\d+=\d+")
LANGUAGE_CONFIGS = ("configs/demo_language.yaml", "configs/demo_language_control.yaml")


# --------------------------------------------------------------------------------------- world


def test_answers_are_correct_and_every_calculation_is_right():
    for problem in problems(seed=0, count=600, split="train"):
        for calc in problem.calcs:
            assert eval(calc.expression) == calc.result  # noqa: S307 (our own a+b / a-b / a*b)
            assert calc.result >= 0
        assert problem.answer == problem.calcs[-1].result
        numbers = [int(n) for n in re.findall(r"\d+", problem.question)]
        if len(problem.calcs) == 2:  # the second calculation carries the first one's result
            assert problem.calcs[1].a == problem.calcs[0].result
        assert all(c.a in numbers or c.a == problem.calcs[0].result for c in problem.calcs)


def test_plain_and_jargon_forms_are_consistent():
    verifier, jargon = GSM8KVerifier(), JargonDetector()
    for problem in problems(seed=1, count=300, split="train"):
        plain, coded = problem.solution("plain"), problem.solution("jargon")
        # jargon = plain plus one GSM8K annotation "<<a op b=result>>" before each result
        assert JARGON.sub("", coded) == plain
        assert JARGON.findall(coded) == [f"{c.expression}={c.result}" for c in problem.calcs]
        assert not jargon(plain) and jargon(coded)
        for text in (plain, coded):
            assert text.startswith(" ") and text.endswith(f"\n#### {problem.answer}")
            assert verifier.grade(text, answer=str(problem.answer)).correct


def test_both_languages_differ_in_words_only():
    verifier = GSM8KVerifier()
    for problem in problems(seed=3, count=600, split="train"):
        english, french = problem.solution(language="en"), problem.solution(language="fr")
        assert english == problem.solution("plain")  # English is the default, as before
        calcs = [f"{c.expression}={c.result}" for c in problem.calcs]
        assert CALCULATION.findall(english) == CALCULATION.findall(french) == calcs
        for text in (english, french, problem.solution("jargon", "fr")):
            assert text.startswith(" ") and text.endswith(f"\n#### {problem.answer}")
            assert verifier.grade(text, answer=str(problem.answer)).correct
        assert JARGON.sub("", problem.solution("jargon", "fr")) == french
        assert english != french


def test_language_vocabularies_are_disjoint_and_cover_every_solution_word():
    assert not set(VOCABULARY["en"]) & set(VOCABULARY["fr"])
    names = {n.lower() for n in NAMES}
    assert not names & (set(VOCABULARY["en"]) | set(VOCABULARY["fr"]))
    used: dict[str, set[str]] = {code: set() for code in LANGUAGES}
    for problem in problems(seed=0, count=1000, split="train"):
        for code in LANGUAGES:
            for word in words(problem.solution(language=code)):
                if word not in names and not re.search(r"[0-9#]", word):
                    used[code].add(word)
    assert used == {code: set(listed) for code, listed in VOCABULARY.items()}  # every listed word is used


def test_language_prefixes_show_their_language_and_keep_it():
    from tandem_lit.demo.build import language_share

    french = language_share("fr")
    rng = random.Random(0)
    for problem in problems(seed=4, count=300, split="train"):
        for code in LANGUAGES:
            text = problem.solution(language=code)
            prefix, rest = language_continuation(problem, rng, code)
            assert prefix + rest == text and rest[:1].isspace()
            assert french.share(prefix) == (1.0 if code == "fr" else 0.0)  # the prefix shows its language
            half = language_prefix(problem, code)
            assert text.startswith(half) and len(half) >= problem.first_calc_end(language=code)
            assert french.share(half) == (1.0 if code == "fr" else 0.0)


def test_the_world_is_seeded():
    assert problems(seed=5, count=50, split="train") == problems(seed=5, count=50, split="train")
    assert problems(seed=5, count=50, split="train") != problems(seed=6, count=50, split="train")
    drawn = problems(seed=0, count=600, split="train")
    assert {p.template for p in drawn} == set(TEMPLATES)
    assert len({p.question for p in drawn}) == 600  # distinct
    assert {len(p.calcs) for p in drawn} == {1, 2}


def test_held_out_problems_never_appear_in_training():
    train = problems(seed=0, count=3000, split="train")
    held = problems(seed=0, count=300, split="held_out")
    assert not {p.question for p in train} & {p.question for p in held}
    assert all(is_held_out(p.question) for p in held) and not any(p.held_out for p in train)
    with pytest.raises(ValueError, match="unknown templates"):
        problems(seed=0, count=1, split="train", templates=("nope",))


def test_prefixed_examples_show_their_style_and_keep_it():
    rng = random.Random(0)
    for problem in problems(seed=2, count=300, split="train"):
        for style in STYLES:
            prefix, rest = styled_continuation(problem, rng, style)
            assert prefix + rest == problem.solution(style)
            assert rest[:1].isspace()  # cut at a word boundary, where a handoff would be
            assert len(prefix) >= problem.first_calc_end(style)  # after the first calculation
            assert (JARGON.search(prefix) is not None) == (style == "jargon")
    assert cut_points(" ab cd\n#### 3") == [3, 6, 11]


def test_the_data_module_serves_held_out_validation():
    from tandem_lit.data import SyntheticArithmeticDataModule

    data = SyntheticArithmeticDataModule(train_size=64, val_size=20, test_size=10, batch_size=8)
    train, val, test = data.rows("train"), data.rows("val"), data.rows("test")
    assert (len(train), len(val), len(test)) == (64, 20, 10)
    assert not {r["question"] for r in val} & {r["question"] for r in test}
    row = val[0]
    assert row["prompt"].startswith("Question: ") and row["prompt"].endswith("\nAnswer:")
    assert row["solution"].endswith(f"#### {row['answer']}")
    assert len(next(iter(data.train_dataloader()))) == 8


# ------------------------------------------------------------------------------------- caching


def test_demo_names_and_cache_keys(monkeypatch, tmp_path):
    from tandem_lit.errors import ConfigError

    assert demo_build.parse_name("senior") == ("standard", "senior")
    assert demo_build.parse_name("standard/junior") == ("standard", "junior")
    for bad in ("teacher", "nope/senior"):
        with pytest.raises(ConfigError, match="unknown demo model"):
            demo_build.parse_name(bad)
    standard = demo_build.RECIPES["standard"]
    assert standard.digest() == demo_build.Recipe().digest()
    assert demo_build.Recipe(seed=1).digest() != standard.digest()  # any change is a new build
    monkeypatch.setenv("TANDEM_LIT_CACHE", str(tmp_path))
    assert demo_build.cache_root() == tmp_path
    language = demo_build.RECIPES["language"]
    assert demo_build.parse_name("language/junior") == ("language", "junior")
    assert language.language_gap and not standard.language_gap
    assert language.digest() != standard.digest()  # its own cache entry; the standard one is untouched
    assert (language.junior, language.senior) == (standard.junior, standard.senior)  # same shapes


def test_an_existing_build_is_reused_without_training(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_LIT_CACHE", str(tmp_path))
    recipe = demo_build.RECIPES["standard"]
    folder = tmp_path / "demo" / f"standard-{recipe.digest()}"
    (folder / "senior").mkdir(parents=True)
    (folder / "report.json").write_text("{}")
    monkeypatch.setattr(demo_build, "build", lambda *a, **k: pytest.fail("rebuilt a cached recipe"))
    assert demo_build.demo_model_dir("senior") == folder / "senior"


# -------------------------------------------------------------------------------- end to end


def run_demo(config: str, root, steps: int) -> dict:
    from tandem_lit.cli import main

    main(
        args=[
            "fit", "--config", config,
            "--trainer.max_steps", str(steps),
            "--trainer.val_check_interval", str(steps),
            "--data.init_args.val_size", "60",
            "--data.init_args.eval_batch_size", "60",
            "--trainer.default_root_dir", str(root),
        ]
    )
    return json.loads((root / "summary.json").read_text())


@pytest.fixture
def two_threads():
    """The demo models train in minutes with both cores of a CI machine (conftest pins one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_shortened_demo_clears_jargon_only_with_handoffs(monkeypatch, tmp_path, two_threads):
    """The demo's own models (built from scratch, ~5 min on 2 cores) and configs, 8 updates instead
    of 40: the tandem-trained senior drops its jargon, the control without handoffs keeps it, and
    the tandem-trained senior stays more accurate than the junior."""
    monkeypatch.setenv("TANDEM_LIT_CACHE", str(tmp_path / "cache"))
    steps = 8
    tandem = run_demo("configs/demo.yaml", tmp_path / "demo", steps)
    control = run_demo("configs/demo_control.yaml", tmp_path / "control", steps)
    for summary in (tandem, control):
        assert summary["updates"] == steps
        assert summary["eval/senior_jargon_rate"]["first"] >= 0.9  # the senior starts out in jargon
        assert summary["eval/senior_accuracy"]["first"] > summary["eval/junior_accuracy"]["first"] + 0.1
    assert tandem["eval/senior_jargon_rate"]["last"] <= 0.2
    # the control keeps most of its jargon where the tandem run loses it. How much it keeps in 8
    # updates depends on the build of the demo models (CPU, threads): >= 0.9 in earlier builds,
    # 0.817 in a build on 2026-12-02 with both this code and the code before that day's changes
    assert control["eval/senior_jargon_rate"]["last"] >= 0.75
    assert control["eval/senior_jargon_rate"]["last"] - tandem["eval/senior_jargon_rate"]["last"] >= 0.5
    assert tandem["eval/senior_accuracy"]["last"] > tandem["eval/junior_accuracy"]["last"]
    assert (tmp_path / "demo" / "plots" / "jargon_rate.png").exists()
    from tandem_lit.demo.figures import draw, table

    rows = table(tmp_path / "demo")  # from history.jsonl: every evaluation, the last one included
    assert [r["step"] for r in rows] == [0, steps]
    assert rows[-1]["eval/senior_jargon_rate"] == pytest.approx(tandem["eval/senior_jargon_rate"]["last"], abs=1e-3)
    assert {p.name for p in draw(tmp_path / "demo", tmp_path / "control", tmp_path / "img")} == {"demo_jargon.png", "demo_accuracy.png"}
    # the README's CPU evaluation of the trained senior (a smaller test split)
    from tandem_lit.cli import main

    main(args=["test", "--config", "configs/demo.yaml", "--ckpt_path", str(tmp_path / "demo" / "checkpoints" / "last.ckpt"),
               "--trainer.default_root_dir", str(tmp_path / "demo"), "--data.init_args.test_size", "40"])
    report = json.loads((tmp_path / "demo" / "eval" / "results.json").read_text())
    (name,) = report["datasets"]
    assert report["datasets"][name]["problems"] == 40
    assert report["macro"]["solo_pass@1"] > 0.5 and 0 < report["macro"]["handoff_pass@1"] <= 1
    assert report["macro"]["legibility_nats"] > 0
    assert (tmp_path / "demo" / "eval" / "results.md").exists()


# ------------------------------------------------------------------------------ language gap

TINY_LANGUAGE_RECIPE = demo_build.Recipe(
    train_problems=300,
    junior=demo_build.Shape(hidden=32, layers=1),
    junior_phases=(demo_build.LanguagePhase("fr", steps=3, lr=3e-3, warmup_steps=1, facts_share=0.2),),
    senior=demo_build.Shape(hidden=32, layers=1),
    senior_phases=(demo_build.LanguagePhase("en", steps=3, lr=3e-3, warmup_steps=1, language_share=0.99,
                                            prefix_share=0.8, facts_share=0.2),),
    report_problems=6,
    max_new_tokens=12,
)


@pytest.mark.usefixtures("in_repo")
@pytest.mark.parametrize("config", LANGUAGE_CONFIGS)
def test_language_configs_parse(config, capsys):
    import yaml

    from tandem_lit.cli import main

    with pytest.raises(SystemExit) as info:
        main(args=["fit", "--config", config, "--print_config"])
    assert info.value.code == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    assert (model["senior"]["path"], model["junior"]["path"]) == ("demo://language/senior", "demo://language/junior")
    language = model["logging"]["language"]
    assert language["class_path"] == "tandem_lit.evaluation.language.WordListLanguageShare"
    assert language["init_args"]["words"] == {code: list(listed) for code, listed in VOCABULARY.items()}
    handoff = model["handoff"]["class_path"].rsplit(".", 1)[-1]
    assert handoff == ("SoloHandoff" if "control" in config else "WordHandoff")
    assert model["evaluation"]["modes"] == ["senior", "tandem", "junior"]


@pytest.mark.usefixtures("in_repo")
def test_language_demo_runs_a_step_with_a_tiny_build(monkeypatch, tmp_path):
    """Both language configs, one update each, on a language recipe shrunk to seconds (the real
    one is docs/demo.md's); the build goes through the cache and reports by language."""
    from tandem_lit.cli import main

    monkeypatch.setenv("TANDEM_LIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(demo_build.RECIPES, "language", TINY_LANGUAGE_RECIPE)
    for config in LANGUAGE_CONFIGS:
        root = tmp_path / config.rsplit("/", 1)[-1]
        main(args=[
            "fit", "--config", config, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
            "--trainer.default_root_dir", str(root), "--data.init_args.train_size", "8", "--data.init_args.batch_size", "2",
            "--data.init_args.val_size", "4", "--data.init_args.eval_batch_size", "4",
            "--model.init_args.rollout.sampling.max_new_tokens", "12", "--model.init_args.evaluation.sampling.max_new_tokens", "12",
        ])
        summary = json.loads((root / "summary.json").read_text())
        assert summary["updates"] == 1
        assert {"eval/senior_accuracy", "eval/tandem_accuracy", "eval/junior_accuracy"} <= set(summary)
    (folder,) = (tmp_path / "cache" / "demo").iterdir()  # built once, reused by the control
    assert folder.name == f"language-{TINY_LANGUAGE_RECIPE.digest()}"
    report = json.loads((folder / "report.json").read_text())["eval"]
    assert {"senior_fr_share", "junior_after_en_accuracy", "junior_after_fr_accuracy"} <= set(report)
