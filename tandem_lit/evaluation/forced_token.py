"""The one-forced-token experiment of the replication/extension (seed 000, "Extension 2").

Is a weak partner's harm in tandem rollouts about single bad tokens? Take the senior's solo
solutions; at one position where the senior's and the junior's most likely next tokens differ
(teacher-forced on the solution), replace the senior's token with the junior's, let the senior
continue alone from there, and grade again. The extension saw success drop by only ~2 points on
APPS: one junior token rarely breaks a solution.

Details: the position is drawn uniformly among the differing positions with the sample's own
seed (reproducible); the continuation uses the test sampling and what is left of the same
token budget (``max_new_tokens`` counts the kept prefix and the forced token); a sample with no
differing position keeps its solo outcome and is counted in ``forced_token_position_rate``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import torch

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.handoff import SoloHandoff
from tandem_lit.rollout.logprobs import completion_top_tokens
from tandem_lit.rollout.record import PromptBatch
from tandem_lit.rollout.result import RolloutResult


@dataclass
class ForcedToken:
    """One solo sample after forcing: ``position`` is None where the two models never disagree."""

    solo_correct: bool
    correct: bool  # after forcing (the solo outcome where nothing was forced)
    position: int | None


def forced_token_outcomes(module, rows: list[dict[str, Any]], solo: RolloutResult, key: int) -> list[ForcedToken]:
    """Force one junior token into each of ``solo``'s samples (``rows``' rollouts) and grade the
    senior's continuation (``key``: the test batch's key; it seeds the position draws and the
    continuations). The junior reads the solution after its own prompt."""
    if module.partner_has_own_tokenizer():
        raise ConfigError(
            "test_forced_token needs a junior with the senior's tokenizer (a forced token is one token of "
            "both vocabularies); set test_forced_token: false for this pair"
        )
    rollout = solo.rollout
    forced: list[tuple[int, int, int]] = []  # (sample, position, junior token)
    per_row = rollout.completion_ids.shape[0] // len(rows)
    prompts = [row["prompt"] for row in rows for _ in range(per_row)]
    for micro in torch.arange(rollout.completion_ids.shape[0], device=module.device).split(module.update_settings.micro_batch_size):
        part = rollout.select(micro).trimmed()
        vocab = len(module.tokenizer)  # tokens the engines write (a head's rows past them are padding)
        senior_top = completion_top_tokens(module.senior, part, vocab)
        junior_view = module.partner_view(part, [prompts[i] for i in micro.tolist()])
        junior_top = completion_top_tokens(module.junior, junior_view, vocab)
        differ = (senior_top != junior_top) & part.completion_mask
        for row, sample in enumerate(micro.tolist()):
            positions = differ[row].nonzero().flatten().tolist()
            if positions:
                position = random.Random(key * 1_000_003 + sample).choice(positions)
                forced.append((sample, position, int(junior_top[row, position])))
    texts = continue_after(module, solo, forced, key)
    samples = [sample for sample, _, _ in forced]
    columns = {name: [values[s] for s in samples] for name, values in solo.columns.items()}
    grades = module.verifier.grade_batch(texts, **columns) if forced else []
    outcomes = [ForcedToken(c, c, None) for c in solo.correct]
    for (sample, position, _), grade in zip(forced, grades):
        outcomes[sample] = ForcedToken(solo.correct[sample], grade.correct, position)
    return outcomes


def continue_after(module, solo: RolloutResult, forced: list[tuple[int, int, int]], key: int) -> list[str]:
    """The full text of each forced sample: the solo prefix, the junior's token, then the senior alone."""
    if not forced:
        return []
    rollout, tokenizer = solo.rollout, module.tokenizer
    budget = module.evaluation.test_sampling.max_new_tokens
    engine = module.rollouts.ready()
    end_ids = set(engine.eos_token_ids)
    prefixes, prompts = [], []
    for sample, position, token in forced:
        prompt = rollout.prompt_ids[sample][rollout.prompt_mask[sample].bool()].tolist()
        prefix = [*rollout.completion_ids[sample, :position].tolist(), token]
        prefixes.append(prefix)
        prompts.append(prompt + prefix)
    continuations: list[list[int]] = [[] for _ in forced]
    todo = [i for i, prefix in enumerate(prefixes) if prefix[-1] not in end_ids and len(prefix) < budget]
    left = [budget - len(prefixes[i]) for i in todo]  # each continuation's share of the token budget
    sampling = dataclasses.replace(module.evaluation.test_sampling, n=1, max_new_tokens=max(left, default=1))
    per_call = max(1, len(todo) if engine.queues_rows else module.rollout_settings.batch_size or len(todo))
    pad = engine.pad_token_id
    for start in range(0, len(todo), per_call):
        chunk = todo[start : start + per_call]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in chunk])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk])
        seeds = torch.tensor([(key * 1_000_003 + forced[i][0] * 7919 + forced[i][1]) & 0xFFFFFFFF for i in chunk])
        budgets = torch.tensor(left[start : start + per_call])
        out = engine.generate(PromptBatch(ids, mask, seeds, max_new_tokens=budgets).to(module.device), SoloHandoff("senior"), sampling)
        for row, i in enumerate(chunk):
            continuations[i] = out.completion_ids[row, : int(out.lengths[row])].tolist()
    return tokenizer.batch_decode([p + c for p, c in zip(prefixes, continuations)], skip_special_tokens=True)
