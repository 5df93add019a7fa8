"""The rollout phase of a training step: prompts in, graded rollouts out; and the engine's life
(bound once, set up per device, weights loaded by policy version, caches released).

    rows -> prompts that fit -> formatted, tokenised prompts (each model its own format)
         -> engine.generate in calls of at most ``rollout.batch_size`` sequences
         -> authorship check (fail closed) -> verifier -> RolloutResult

Dynamic sampling (DAPO) repeats this over more of the data batch until enough prompt groups have
rewards that differ. Partial rollouts (``rollout.partial``) keep more groups in flight than a step
trains, across steps (``partial.InFlight``). On several processes every rank takes its share of a step's groups
(``distributed.Shares``), and every rank decides which groups those are as one process would.
Validation and test draw their rollouts through the same ``generate``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from tandem_lit.objectives.base import AuthorshipError
from tandem_lit.rollout.engine import EngineTiming, KVBudget, RolloutEngine
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.rollout.record import Author, PausedSequence, PromptBatch, Rollout, StopRule
from tandem_lit.rollout.result import RolloutResult, concat_results
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.weights import gathered, rollout_dtype, rollout_named_tensors
from tandem_lit.training.distributed import Shares
from tandem_lit.training.partial import InFlight
from tandem_lit.training.settings import OverlongPolicy, PromptFormat, RolloutSettings
from tandem_lit.verifiers.base import Verifier

log = logging.getLogger(__name__)

ONE_PROCESS = Shares()


class RolloutPhase:
    """Generates and grades rollouts for rows of a data batch, and owns the engine's life.

    ``bind`` gives it the models, tokenizers and engine once (``TandemModule.configure_model``).
    ``ready`` sets the engine up where the senior lives now (again when Lightning moved it), with
    ``rollout.batch_size`` as the sequences it decodes at once, and before a rollout loads the
    trained weights into the engine's rollout copy when the policy moved since the last load
    (``policy_moved``: optimiser updates, a loaded checkpoint). ``release`` frees its caches for
    the update. ``timing``: the engine's phase times over a training step's calls.
    """

    def __init__(self, settings: RolloutSettings, verifier: Verifier, overlong: OverlongPolicy | None = None):
        self.settings = settings
        self.overlong = overlong or OverlongPolicy()  # the update's: what dynamic sampling filters on
        self.verifier = verifier
        self.senior: nn.Module | None = None
        self.junior: nn.Module | None = None
        self.tokenizer = None
        self.junior_tokenizer = None
        self.engine: RolloutEngine | None = None
        self.policy_version = 0  # optimiser updates (and checkpoint loads) so far
        self._engine_version = 0  # the policy version the engine decodes
        self._engine_device: torch.device | None = None  # where the engine was set up (None: not yet)
        self.timing: EngineTiming | None = None  # the engine's phase times, summed over a training step's calls
        # per-row token budgets from the rows' seeds ([B] -> [B] long, each <= max_new_tokens), or
        # None (every row may use sampling.max_new_tokens). Keyed by seed, so a row's budget does
        # not depend on how rows are split into calls: benchmarks put real length distributions
        # on random-weight models this way (benchmarks/train_step.py --lengths).
        self.token_budgets: Callable[[Tensor], Tensor] | None = None
        # partial rollouts (``rollout.partial``): the groups in flight across steps
        self.in_flight = InFlight(settings.partial) if settings.partial is not None else None

    # -------------------------------------------------------------------------------- engine

    def bind(self, senior: nn.Module, junior: nn.Module | None, tokenizer, junior_tokenizer, engine: RolloutEngine) -> None:
        """The models the engine decodes (the trained senior, the frozen junior), their tokenizers
        (every prompt is encoded here) and the engine; it is set up at the first ``ready``."""
        self.senior, self.junior, self.engine = senior, junior, engine
        self.tokenizer, self.junior_tokenizer = tokenizer, junior_tokenizer
        self._engine_device = None

    @property
    def device(self) -> torch.device:
        """Where the senior lives now (prompts go there)."""
        return next(self.senior.parameters()).device

    def engine_params(self) -> dict[str, str]:
        """The engine and the dtype it decodes the senior in, for the run's hyperparameters."""
        requested = self.engine.rollout_dtype
        dtype = next(self.senior.parameters()).dtype if requested == "live" else rollout_dtype(requested, self.senior)
        return {"engine": type(self.engine).__name__, "rollout_dtype": str(dtype).removeprefix("torch.")}

    def plan_kv_cache(self, budget: KVBudget) -> str | None:
        """Hand the engine a training run's KV budget, before its setup (``RolloutEngine.plan_kv_cache``)."""
        return self.engine.plan_kv_cache(budget)

    def ready(self) -> RolloutEngine:
        """The engine, set up with the models where they now live, its rollout copy loaded with
        the current trained weights (once per rollout phase after updates). Call it on every rank
        at once: with FSDP, filling the rollout copy gathers the senior's shards (a collective)."""
        if self._engine_device != self.device:
            with gathered(self.senior):  # (a no-op unless FSDP shards the senior)
                self.engine.setup(self.senior, self.junior, self.tokenizer, self.junior_tokenizer, self.settings.batch_size)
            self._engine_device = self.device
            self._engine_version = self.policy_version
        elif self._engine_version != self.policy_version:
            if self.engine.decodes_copy:
                with gathered(self.senior):
                    self.engine.load_weights(rollout_named_tensors(self.senior))
            self._engine_version = self.policy_version
        return self.engine

    def policy_moved(self, updates: int = 1) -> None:
        """The trained weights changed (optimiser updates, a loaded checkpoint): the engine's copy
        is refreshed before the next rollout."""
        self.policy_version += updates

    def save_carry(self, checkpoint: dict[str, Any]) -> None:
        """Partial rollouts: the carried groups' rows and seeds into a checkpoint (what they wrote is
        not saved: a resumed run draws them again, first)."""
        if self.in_flight is not None:
            checkpoint["tandem_lit_partial"] = self.in_flight.state_dict()

    def loaded(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint's weights were loaded: they reach the engine's copy before the next rollout,
        and the carried groups it saved are in flight again."""
        self.policy_moved()
        if self.in_flight is not None:
            self.in_flight.load_state_dict(checkpoint.get("tandem_lit_partial", {}))

    def release(self) -> None:
        """Free the engine's caches until the next rollout (the update's activations get their memory)."""
        if self._engine_device is not None:
            self.engine.release()

    # ------------------------------------------------------------------------------- prompts

    def format_prompt(self, prompt: str, tokenizer=None, fmt: PromptFormat | None = None) -> str:
        """The model input for a row's prompt (``PromptFormat.render``; the senior's format by default)."""
        return (fmt or self.settings.prompt_format).render(prompt, tokenizer or self.tokenizer)

    def encode_prompts(self, prompts: list[str], tokenizer=None, padding: bool = True, fmt: PromptFormat | None = None) -> dict:
        """Token ids of formatted prompts (left-padded; a chat template brings its own special tokens)."""
        tokenizer = tokenizer or self.tokenizer
        fmt = fmt or self.settings.prompt_format
        texts = [self.format_prompt(p, tokenizer, fmt) for p in prompts]
        add_special = not fmt.uses_chat_template(tokenizer)
        if not padding:
            return tokenizer(texts, add_special_tokens=add_special)
        return tokenizer(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=add_special)

    def encode_junior_prompts(self, prompts: list[str]) -> dict:
        """The prompts as the junior reads them: its tokenizer and its own prompt format."""
        return self.encode_prompts(prompts, self.junior_tokenizer, fmt=self.settings.junior_prompt_format or self.settings.prompt_format)

    def prompts_that_fit(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """The rows whose formatted prompt fits ``max_prompt_tokens``, and how many were skipped."""
        limit = self.settings.max_prompt_tokens
        if limit is None:
            return list(rows), 0
        lengths = [len(ids) for ids in self.encode_prompts([row["prompt"] for row in rows], padding=False)["input_ids"]]
        kept = [row for row, n in zip(rows, lengths) if n <= limit]
        return kept, len(rows) - len(kept)

    # ------------------------------------------------------------------------------ rollouts

    def generate(
        self, rows: list[dict[str, Any]], policy: HandoffPolicy, sampling: SamplingConfig, key: int,
        row_ids: list[int] | None = None,
    ) -> RolloutResult:
        """Generate ``sampling.n`` rollouts per row and grade them. ``key`` fixes the seeds;
        ``row_ids``, the rows' places in the whole batch when they are one rank's share of it.

        An engine that queues rows (FastEngine, VLLMEngine) gets them all in one call and decodes
        ``rollout.batch_size`` at a time, refilling as sequences finish; any other gets calls of at
        most ``rollout.batch_size`` sequences. Seeds are those of the whole batch, so how the rows
        are split changes nothing else.
        """
        seeds = sequence_seeds(sampling.seed, key, (max(row_ids) + 1 if row_ids else len(rows)) * sampling.n)
        if row_ids:  # the seeds these rows get in one process
            seeds = seeds.view(-1, sampling.n)[torch.tensor(row_ids)].reshape(-1)
        engine = self.ready()
        per_call = len(rows) if engine.queues_rows else max(1, (self.settings.batch_size or len(rows) * sampling.n) // sampling.n)
        parts = []
        for start in range(0, len(rows), per_call):
            chunk = rows[start : start + per_call]
            part = self._generate_chunk(engine, chunk, policy, sampling, seeds[start * sampling.n : (start + len(chunk)) * sampling.n])
            part.group += start
            parts.append(part)
        return parts[0] if len(parts) == 1 else concat_results(parts, engine.pad_token_id)

    def _generate_chunk(self, engine: RolloutEngine, rows: list[dict[str, Any]], policy: HandoffPolicy, sampling: SamplingConfig,
                        seeds: Tensor) -> RolloutResult:
        prompts_text = [row["prompt"] for row in rows for _ in range(sampling.n)]
        rollout = self.decode(engine, prompts_text, seeds, policy, sampling)
        self.check_authorship(rollout, policy)
        columns = {name: [row[name] for row in rows for _ in range(sampling.n)] for name in rows[0] if name != "prompt"}
        grades = self.verifier.grade_batch(rollout.texts, **columns)
        group = torch.arange(len(rows)).repeat_interleave(sampling.n)
        return RolloutResult(rollout, grades, group, columns)

    def decode(self, engine: RolloutEngine, texts: list[str], seeds: Tensor, policy: HandoffPolicy,
               sampling: SamplingConfig, resume: list[PausedSequence | None] | None = None,
               stop: StopRule | None = None) -> Rollout:
        """One ``generate`` of these prompts' sequences, each model's prompts in its own format. For
        partial rollouts (an engine that ``pauses``): ``resume``, what each wrote in an earlier call
        (or None), and ``stop``, where the call ends. Its time is added to ``timing``."""
        encoded = self.encode_prompts(texts)
        partner = None
        if self.junior is not None and (engine.needs_partner_prompts or self.settings.junior_prompt_format):
            junior = self.encode_junior_prompts(texts)
            partner = PromptBatch(junior["input_ids"], junior["attention_mask"], seeds)
        budgets = self.token_budgets(seeds) if self.token_budgets is not None else None
        prompts = PromptBatch(encoded["input_ids"], encoded["attention_mask"], seeds, partner, max_new_tokens=budgets,
                              resume=resume).to(self.device)
        # (``stop`` only where there is one: an engine that never pauses need not take it)
        rollout = engine.generate(prompts, policy, sampling) if stop is None else engine.generate(prompts, policy, sampling, stop=stop)
        timing = engine.last_timing()
        if timing is not None:
            self.timing = timing if self.timing is None else self.timing + timing
        return rollout

    def check_authorship(self, rollout: Rollout, policy: HandoffPolicy) -> None:
        """Fail closed: a tandem batch must carry authorship that follows the policy's draws."""
        if rollout.author is None:
            raise AuthorshipError("the engine returned rollouts without an author tensor")
        junior_tokens = int((rollout.author == Author.JUNIOR).sum())
        if policy.only_author == Author.SENIOR and junior_tokens:
            raise AuthorshipError(f"{policy!r} should give all-senior rollouts, but {junior_tokens} tokens are junior's")
        if policy.only_author is not None:
            return
        draws, junior = int(rollout.decisions.sum()), int(rollout.junior_draws.sum())
        if junior > 0 and junior_tokens == 0 and int(rollout.lengths.sum()) > draws:
            raise AuthorshipError("the junior was drawn but wrote no token: authorship was lost on the way")
        if draws >= 20 and 0 < policy.p < 1:
            z = (junior - policy.p * draws) / math.sqrt(draws * policy.p * (1 - policy.p))
            if abs(z) > self.settings.authorship_z:
                raise AuthorshipError(
                    f"the junior won {junior} of {draws} handoff draws with p={policy.p} (z={z:.1f}); "
                    "the engine is not following the handoff policy"
                )

    def training_rollouts(self, rows: list[dict[str, Any]], policy: HandoffPolicy, key: int,
                          shares: Shares = ONE_PROCESS) -> tuple[RolloutResult | None, dict[str, float]]:
        """This rank's graded rollouts of a training step over ``rows`` (the prompts of the whole
        data batch that fit), and the step's rollout metrics; None when the step trains no group.
        Every rank gets the same ``rows`` and decides the same groups (``Shares``). ``timing``
        starts again here: it is this step's."""
        self.timing = None
        if self.in_flight is not None:  # (carried groups may train in a step without new rows)
            return self.in_flight.step(self, rows, policy, key, shares)
        if not rows:
            return None, {}
        if self.settings.dynamic_sampling is not None:
            return self.informative(rows, policy, key, shares)
        trained = shares.balanced(len(rows))
        mine = shares.of_step(trained)
        result = self.generate([rows[i] for i in mine], policy, self.settings.sampling, key, mine) if mine else None
        return result, ({"balance_dropped_groups": float(len(rows) - trained)} if shares.world > 1 else {})

    def trained_rewards(self, result: RolloutResult) -> Tensor:  # -> [N]
        """The rewards the objective will see (``overlong`` applied): dynamic sampling keeps the
        groups whose trained rewards differ (``OverlongPolicy``)."""
        rollout = result.rollout
        return self.overlong.rewards(result.rewards, rollout.lengths.cpu(), rollout.truncated.cpu(),
                                     self.settings.sampling.max_new_tokens)

    def informative(self, pool: list[dict[str, Any]], policy: HandoffPolicy, key: int,
                    shares: Shares = ONE_PROCESS) -> tuple[RolloutResult | None, dict[str, float]]:
        """Dynamic sampling: rollouts of up to ``prompts_per_step`` prompts whose rewards differ.

        Each round draws the next rows of the pool that the groups kept so far leave missing; on W
        ranks each rank rolls out its part of the round with one process's seeds, and the ranks add
        up which groups have spread, so every rank keeps (and counts rounds, and stops) as one
        process does. The kept groups are then dealt as ``rank_rows`` of them (``Shares.deal``).
        """
        settings = self.settings.dynamic_sampling
        target, dropped, rounds, start, found = settings.prompts_per_step, 0, 0, 0, 0
        kept: dict[int, RolloutResult] = {}  # place among every rank's kept groups -> one group this rank rolled out
        engine = self.ready()  # on every rank: loading the rollout copy gathers FSDP shards (a collective)
        while found < target and start < len(pool) and rounds < settings.max_rounds:
            rows = pool[start : start + target - found]
            start += len(rows)
            mine = shares.of_round(len(rows))
            result = self.generate([rows[i] for i in mine], policy, self.settings.sampling, key * 16 + rounds, mine) if mine else None
            rounds += 1
            spread = [0.0] * len(rows)
            for group in result.groups_with_spread(self.trained_rewards(result)) if result is not None else []:
                spread[mine[group]] = 1.0
            useful = [i for i, flag in enumerate(shares.total(spread)) if flag]
            for place, i in enumerate(useful, start=found):
                if i in mine:
                    kept[place] = result.keep_groups([mine.index(i)], offset=0)
            dropped += len(rows) - len(useful)
            found += len(useful)
        trained = shares.balanced(found)
        stats = {"sampling_rounds": float(rounds), "dropped_groups": float(dropped), "kept_groups": float(found)}
        if shares.world > 1:
            stats["balance_dropped_groups"] = float(found - trained)
        share = shares.deal(kept, trained)
        if share:
            device = self.device
            parts = [replace(part.to(device), group=torch.full_like(part.group, i)) for i, part in enumerate(share)]
            return concat_results(parts, engine.pad_token_id), stats
        if found:
            log.warning("dynamic sampling kept %d prompt group(s), fewer than the %d processes that train equal shares: "
                        "no update this step", found, shares.world)
        else:
            log.warning("dynamic sampling found no prompt with differing rewards in %d rounds: no update this step", rounds)
        return None, stats
