"""The one-forced-token experiment: the forced token is the junior's top token at a position where
the two models disagree, the prefix before it is the senior's solo text, the rest is the senior's
own continuation within the same token budget, and the report carries the change in success."""

from __future__ import annotations

import pytest
import torch

from tandem_lit.cli import main
from tandem_lit.evaluation.forced_token import continue_after, forced_token_outcomes
from tandem_lit.objectives import Reinforce
from tandem_lit.rollout import SamplingConfig, SoloHandoff
from tandem_lit.rollout.logprobs import completion_top_tokens
from tandem_lit.training.settings import PromptFormat
from tandem_lit.verifiers import ArithmeticVerifier
from tests.conftest import tiny_tandem_module

pytestmark = [pytest.mark.usefixtures("in_repo"), pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode")]

ROWS = [{"prompt": "ab c", "answer": "3"}, {"prompt": "e.d", "answer": "7"}]
BUDGET = 20


def module_with(junior, small_tok, senior):
    """A module over the wide-init tiny models of conftest (varied greedy text over a small alphabet)."""
    from tandem_lit.rollout.choice import default_engine

    module = tiny_tandem_module(
        verifier=ArithmeticVerifier(), objective=Reinforce(),
        test_sampling=SamplingConfig(temperature=0.0, max_new_tokens=BUDGET, n=2),
        test_forced_token=True, micro_batch_size=3, prompt_format=PromptFormat(chat_template=False),
    )
    module.engine = default_engine(senior, junior)
    module.bind_models(senior, junior, small_tok, small_tok)
    return module


def test_the_forced_token_is_the_juniors_top_token_and_the_senior_continues_greedily(small_model, other_small_model, small_tok):
    module = module_with(other_small_model, small_tok, small_model)
    solo = module.rollouts.generate(ROWS, SoloHandoff("senior"), module.evaluation.test_sampling, key=0)
    # greedy solo text is the senior's own top token at every position (teacher-forced)
    senior_top = completion_top_tokens(module.senior, solo.rollout)
    mask = solo.rollout.completion_mask
    assert torch.equal(senior_top[mask], solo.rollout.completion_ids[mask])
    junior_top = completion_top_tokens(module.junior, solo.rollout)
    sample, position = next((i, int((senior_top[i] != junior_top[i])[mask[i]].nonzero()[0])) for i in range(4)
                            if ((senior_top[i] != junior_top[i]) & mask[i]).any())
    token = int(junior_top[sample, position])
    [text] = continue_after(module, solo, [(sample, position, token)], key=0)
    prefix = solo.rollout.completion_ids[sample, :position].tolist() + [token]
    # the senior's greedy continuation from prompt + prefix, by plain transformers
    prompt = solo.rollout.prompt_ids[sample][solo.rollout.prompt_mask[sample].bool()].tolist()
    ids = torch.tensor([prompt + prefix])
    left = BUDGET - len(prefix)
    if token not in module.engine.eos_token_ids and left > 0:
        out = module.senior.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=left, do_sample=False,
                                     eos_token_id=module.engine.eos_token_ids, pad_token_id=module.engine.pad_token_id)
        continuation = out[0, ids.shape[1]:].tolist()
    else:
        continuation = []
    expected = module.tokenizer.decode(prefix + continuation, skip_special_tokens=True)
    assert text == expected
    assert text != solo.rollout.texts[sample] or token in module.engine.eos_token_ids


def test_a_junior_identical_to_the_senior_leaves_nothing_to_force(small_model, small_tok):
    module = module_with(small_model, small_tok, small_model)
    solo = module.rollouts.generate(ROWS, SoloHandoff("senior"), module.evaluation.test_sampling, key=0)
    outcomes = forced_token_outcomes(module, ROWS, solo, key=0)
    assert len(outcomes) == 4
    assert all(o.position is None and o.correct == o.solo_correct for o in outcomes)


def test_outcomes_are_reproducible_and_positions_lie_inside_the_text(small_model, other_small_model, small_tok):
    module = module_with(other_small_model, small_tok, small_model)
    solo = module.rollouts.generate(ROWS, SoloHandoff("senior"), module.evaluation.test_sampling, key=0)
    first = forced_token_outcomes(module, ROWS, solo, key=0)
    assert first == forced_token_outcomes(module, ROWS, solo, key=0)
    lengths = solo.rollout.lengths.tolist()
    forced = [(o, n) for o, n in zip(first, lengths) if o.position is not None]
    assert forced, "the two random models never disagreed: the test has no teeth"
    assert all(0 <= o.position < n for o, n in forced)


def test_the_cli_report_carries_the_forced_token_numbers(tmp_path):
    from tests.test_evaluation import math_eval_root, strict_json, tiny_test_args

    main(args=tiny_test_args(tmp_path / "run", math_eval_root(tmp_path), "--model.init_args.evaluation.test_forced_token", "true"))
    report = strict_json(tmp_path / "run" / "eval" / "results.json")
    for name in ("aime24", "amc23"):
        row = report["datasets"][name]
        assert 0.0 <= row["forced_token_accuracy"] <= 1.0
        assert row["forced_token_change"] == pytest.approx(row["forced_token_accuracy"] - row["solo_pass@1"])
        assert 0.0 <= row["forced_token_position_rate"] <= 1.0  # (these tiny random models rarely disagree)
    assert "forced_token_change" in report["macro"]
    assert "forced_token_change" in (tmp_path / "run" / "eval" / "results.md").read_text()
