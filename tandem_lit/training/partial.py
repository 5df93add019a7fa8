"""Partial rollouts (``rollout.partial``): the prompt groups in flight across the end of a step.

A step's rollout phase with partial rollouts on:

    carried groups (oldest first) + the step's new groups         = the groups in flight
    -> staleness: carried sequences that would exceed ``max_staleness`` are redrawn, or must
       finish in this phase (``stale``); a step makes one update per PPO mini-batch, and a
       ``max_staleness`` below a step's updates is refused
    -> the engine decodes every unfinished sequence (paused ones resume from what they wrote)
       until the step's groups are complete (``StopRule``), pausing the rest
    -> the first complete groups (those that must train now first, then in flight order) are
       graded and trained; the others are carried to the next step (with ``keep_caches``, the
       paused sequences' keys and values of the junior, or of both models, wait in host memory)

Each token keeps the policy version that wrote it, so a trained rollout carries
``Rollout.staleness``: updates between the senior weights that wrote each senior token and the
weights the step updates (junior tokens are never stale: the junior is frozen).

How many groups a step trains: ``in_flight_prompts`` is the data batch plus a carry-over of
``in_flight_prompts - batch``; a step trains the batch's count of groups once that many are in
flight, fewer in the first steps (every row of every batch trains once, none is lost). On W
processes each rank keeps its own groups (a group stays on one rank), ``in_flight_prompts / W``
of them, and the ranks train the same count of groups each step.

Checkpoints: the carried groups' prompt rows and seeds are saved; a run resumed from a checkpoint
draws them again from their prompts (what they had written is not saved), so no row of a consumed
batch is lost or trained twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.engine import RolloutEngine
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.rollout.record import Author, PausedSequence, Rollout, StopRule, concat_rollouts
from tandem_lit.rollout.result import RolloutResult
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.training.distributed import Shares, max_over_ranks
from tandem_lit.training.settings import PartialRollouts, RolloutSettings
from tandem_lit.verifiers.base import Verifier


class RolloutPhase(Protocol):
    """What a partial phase uses of ``training.rollout_phase.RolloutPhase`` (declared here: the
    phase imports this module, so this one does not import it back)."""

    settings: RolloutSettings
    verifier: Verifier
    engine: RolloutEngine
    policy_version: int

    @property
    def device(self) -> torch.device: ...

    def ready(self) -> RolloutEngine: ...

    def decode(self, engine: RolloutEngine, texts: list[str], seeds: Tensor, policy: HandoffPolicy,
               sampling: SamplingConfig, resume: list[PausedSequence | None] | None = None,
               stop: StopRule | None = None) -> Rollout: ...

    def check_authorship(self, rollout: Rollout, policy: HandoffPolicy) -> None: ...

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One rollout of a group in flight: paused (what it wrote so far), or ended (``done``)."""

    seed: int
    paused: PausedSequence | None = None  # None: nothing written yet
    versions: Tensor | None = None  # [written] long: the policy version that wrote each token
    done: Rollout | None = None  # one row, once it ended

    @property
    def written(self) -> int:
        return 0 if self.paused is None else self.paused.written

    def authors(self) -> Tensor:
        if self.done is not None:
            return self.done.author[0, : int(self.done.lengths[0])].cpu()
        return self.paused.authors if self.paused is not None else torch.zeros(0, dtype=torch.int8)

    def oldest_senior(self) -> int | None:
        """The policy version of its oldest senior token (None: it holds none, so it is not stale)."""
        if self.versions is None or not self.versions.numel():
            return None
        senior = self.authors()[: self.versions.numel()].long() == Author.SENIOR
        return int(self.versions[senior].min()) if bool(senior.any()) else None

    def redraw(self) -> None:
        self.paused, self.versions, self.done = None, None, None


@dataclass
class Group:
    """A prompt's rollouts in flight; it trains once every one of them ended."""

    row: dict[str, Any]
    members: list[Member]
    must_finish: bool = False  # ``stale: correct``: it trains in this step (set per phase)

    @property
    def complete(self) -> bool:
        return all(m.done is not None for m in self.members)

    def oldest_senior(self) -> int | None:
        versions = [v for v in (m.oldest_senior() for m in self.members) if v is not None]
        return min(versions) if versions else None


@dataclass
class PhaseCounts:
    """What a partial rollout phase did, for the step's metrics."""

    in_flight: int = 0
    carried_in: int = 0
    resumed: int = 0
    redrawn: int = 0
    finished_stale: int = 0
    paused: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class InFlight:
    """The groups carried from one step to the next, and one step's partial rollout phase."""

    def __init__(self, settings: PartialRollouts):
        self.settings = settings
        self.groups: list[Group] = []  # carried, oldest first

    # ---------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The carried groups' rows and seeds (not what they wrote: they are redrawn on resume)."""
        return {"groups": [{"row": g.row, "seeds": [m.seed for m in g.members]} for g in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [Group(g["row"], [Member(int(s)) for s in g["seeds"]]) for g in state.get("groups", [])]

    # ---------------------------------------------------------------------------------- a step

    def step(self, phase: RolloutPhase, rows: list[dict[str, Any]], policy: HandoffPolicy, key: int,
             shares: Shares) -> tuple[RolloutResult | None, dict[str, float]]:
        """This rank's trained groups of a step over the new ``rows`` (the data batch's prompts
        that fit), and the phase's metrics."""
        sampling = phase.settings.sampling
        engine = phase.ready()
        if not engine.pauses:
            raise ConfigError(f"rollout.partial needs an engine that pauses and resumes sequences (HFEngine, FastEngine); "
                              f"{type(engine).__name__} does not")
        if self.settings.keep_caches != "none":
            if (reason := engine.why_no_kept_caches()) is not None:
                raise ConfigError(f"rollout.partial.keep_caches: {self.settings.keep_caches}: {reason}")
            if engine.junior is None:
                raise ConfigError(f"rollout.partial.keep_caches: {self.settings.keep_caches} keeps the junior's cache, "
                                  "and this run has no junior: set keep_caches: none")
        mine = shares.of_step(shares.balanced(len(rows)))
        new = []
        if mine:
            seeds = sequence_seeds(sampling.seed, key, (max(mine) + 1) * sampling.n).view(-1, sampling.n)
            new = [Group(rows[i], [Member(int(s)) for s in seeds[i].tolist()]) for i in mine]
        version = phase.policy_version
        counts = PhaseCounts(carried_in=len(self.groups))
        pool = self.groups + new
        counts.in_flight = len(pool)
        carry = max(self.settings.in_flight_prompts // shares.world - len(mine), 0)
        if carry:
            self.check_bound(shares, len(mine))
        base = max(1, min(len(mine), len(pool) - carry)) if pool else 0
        counts.redrawn = self.redraw_stale(pool, version)
        # every rank trains as many groups (their pools are as large), so every rank takes the same
        # turns of this loop: groups that must finish train now, and more trained groups make more
        # updates, which brings other groups' bound nearer
        trained = max_over_ranks(base, shares.device) if shares.world > 1 else base
        while True:
            counts.finished_stale = self.mark_must_finish(pool, version, shares.updates(trained))
            need = max(trained, sum(g.must_finish for g in pool))
            if shares.world > 1:
                need = max_over_ranks(need, shares.device)
            if need == trained:
                break
            trained = need
        trained = min(trained, len(pool))
        counts.resumed = sum(1 for g in pool for m in g.members if m.done is None and m.written > 0)
        self.decode(phase, engine, pool, trained, policy, version, counts)
        chosen = self.choose(pool, trained)
        self.groups = [g for i, g in enumerate(pool) if i not in set(chosen)]
        for group in self.groups:
            group.must_finish = False
        stats = {
            "partial_in_flight_groups": float(counts.in_flight),
            "partial_carried_in_groups": float(counts.carried_in),
            "partial_carried_groups": float(len(self.groups)),
            "partial_trained_groups": float(len(chosen)),
            "partial_resumed_sequences": float(counts.resumed),
            "partial_paused_sequences": float(counts.paused),
            "partial_redrawn_sequences": float(counts.redrawn),
            "partial_finished_stale_sequences": float(counts.finished_stale),
        }
        if not chosen:
            return None, stats
        result = self.graded(phase, [pool[i] for i in chosen], policy, version)
        stats.update(staleness_stats(result.rollout))
        return result, stats

    def check_bound(self, shares: Shares, groups: int) -> None:
        """A carried senior token trains at least one step's updates after it was written: refuse a
        ``max_staleness`` below what a step of ``groups`` (this rank's) makes, which no carried
        sequence could meet."""
        updates = shares.updates(groups)
        if updates > self.settings.max_staleness:
            raise ConfigError(
                f"rollout.partial.max_staleness is {self.settings.max_staleness}, but a step makes {updates} optimiser updates "
                f"({groups * shares.world} prompt groups in PPO mini-batches of update.mini_batch_size "
                f"{shares.prompts_per_update}), so a carried token is at least {updates} updates old when it trains: "
                f"set max_staleness >= {updates}")

    def redraw_stale(self, pool: list[Group], version: int) -> int:
        """``stale: redraw``: drop what a carried sequence wrote when its oldest senior token is
        already more than ``max_staleness`` updates behind ``version``. Returns the sequences redrawn."""
        redrawn = 0
        if self.settings.stale == "redraw":
            for member in (m for group in pool for m in group.members):
                oldest = member.oldest_senior()
                if oldest is not None and version - oldest > self.settings.max_staleness:
                    member.redraw()
                    redrawn += 1
        return redrawn

    def mark_must_finish(self, pool: list[Group], version: int, updates: int) -> int:
        """``stale: correct``: a group holding a senior token that would exceed ``max_staleness``
        were it carried once more (past this step's ``updates``) must finish and train in this phase.
        Returns the sequences that must finish."""
        finishing = 0
        if self.settings.stale == "correct":
            for group in pool:
                oldest = group.oldest_senior()
                group.must_finish = oldest is not None and version + updates - oldest > self.settings.max_staleness
                finishing += sum(m.done is None for m in group.members) if group.must_finish else 0
        return finishing

    def decode(self, phase: RolloutPhase, engine, pool: list[Group], trained: int, policy: HandoffPolicy,
               version: int, counts: PhaseCounts) -> None:
        """Run the unfinished sequences of ``pool`` until ``trained`` groups are complete and every
        group that must finish has; calls of at most ``rollout.batch_size`` sequences (whole groups)
        for an engine without a queue, one call for an engine with one."""
        sampling = phase.settings.sampling
        open_groups = [i for i, g in enumerate(pool) if not g.complete]
        limit = None if engine.queues_rows else phase.settings.batch_size
        calls: list[list[int]] = []
        for i in open_groups:
            size = sum(m.done is None for m in pool[i].members)
            if calls and (limit is None or sum(sum(m.done is None for m in pool[j].members) for j in calls[-1]) + size <= limit):
                calls[-1].append(i)
            else:
                calls.append([i])
        for groups in calls:
            complete = sum(g.complete for g in pool)
            must = any(pool[i].must_finish for i in groups)
            if complete >= trained and not must:
                continue  # not started: they wait in flight
            members = [(i, m) for i in groups for m in pool[i].members if m.done is None]
            stop = StopRule(group=[i for i, _ in members], groups=trained - complete,
                            must_finish=[pool[i].must_finish for i, _ in members],
                            keep_caches=self.settings.kept_models)
            texts = [pool[i].row["prompt"] for i, _ in members]
            seeds = torch.tensor([m.seed for _, m in members], dtype=torch.long)
            rollout = phase.decode(engine, texts, seeds, policy, sampling, [m.paused for _, m in members], stop)
            for row, (_, member) in enumerate(members):
                before = member.versions if member.versions is not None else torch.zeros(0, dtype=torch.long)
                paused = rollout.paused[row] if rollout.paused is not None else None
                if paused is None:
                    member.done = rollout.select([row]).to("cpu")
                    length = int(member.done.lengths[0])
                    member.paused = None
                else:
                    member.paused = paused
                    length = paused.written
                    counts.paused += 1
                member.versions = torch.cat([before, torch.full((length - before.numel(),), version, dtype=torch.long)])

    def choose(self, pool: list[Group], trained: int) -> list[int]:
        """The groups a step trains: complete ones, those that must train now first, then in
        flight order (carried before new), ``trained`` of them (more when more must)."""
        complete = [i for i, g in enumerate(pool) if g.complete]
        must = [i for i in complete if pool[i].must_finish]
        rest = [i for i in complete if not pool[i].must_finish]
        return sorted(must + rest[: max(trained - len(must), 0)])

    def graded(self, phase: RolloutPhase, groups: list[Group], policy: HandoffPolicy, version: int) -> RolloutResult:
        """The trained groups' rollouts, graded, with each token's staleness at ``version``."""
        members = [m for g in groups for m in g.members]
        parts = []
        for member in members:
            length = int(member.done.lengths[0])
            width = member.done.author.shape[1]
            age = torch.zeros((1, width), dtype=torch.long)
            senior = member.done.author[0, :length].long() == Author.SENIOR
            age[0, :length] = torch.where(senior, version - member.versions[:length], 0)
            parts.append(replace(member.done, staleness=age))
        rollout = concat_rollouts(parts, phase.engine.pad_token_id).to(phase.device)
        phase.check_authorship(rollout, policy)
        n = phase.settings.sampling.n
        rows = [g.row for g in groups]
        columns = {name: [row[name] for row in rows for _ in range(n)] for name in rows[0] if name != "prompt"}
        grades = phase.verifier.grade_batch(rollout.texts, **columns)
        group = torch.arange(len(rows)).repeat_interleave(n)
        return RolloutResult(rollout, grades, group, columns)


def use_correction(settings: PartialRollouts, objective) -> None:
    """Set the objective up to correct stale senior tokens as ``settings.correction`` says."""
    if settings.keep_caches == "both" and objective.tis_cap is None:
        raise ConfigError("rollout.partial.keep_caches: both resumes the senior on keys its old weights wrote, so its "
                          "next tokens are drawn from neither policy: set objective.init_args.tis_cap (verl uses 2.0) "
                          "to correct them, or keep_caches: junior")
    if settings.correction == "tis":
        if objective.tis_cap is None:
            raise ConfigError("rollout.partial.correction: tis corrects stale tokens with the objective's tis_cap, which is "
                              "not set: set objective.init_args.tis_cap (verl uses 2.0), or use correction: decoupled")
        objective.stale_cap = None
    else:
        objective.stale_cap = settings.correction_cap


def staleness_stats(rollout: Rollout) -> dict[str, float]:
    """Senior tokens by staleness: the share written by older weights, their mean and largest age."""
    if rollout.staleness is None:
        return {}
    senior = rollout.author.long() == Author.SENIOR
    tokens = int(senior.sum())
    stale = senior & (rollout.staleness > 0)
    count = int(stale.sum())
    return {
        "stale_token_fraction": count / tokens if tokens else 0.0,
        "stale_token_mean_age": float(rollout.staleness[stale].float().mean()) if count else 0.0,
        "stale_token_max_age": float(rollout.staleness[stale].max()) if count else 0.0,
    }
