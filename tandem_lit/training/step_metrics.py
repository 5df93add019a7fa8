"""A training step's metrics: the one row it logs (``train/<name>``), assembled from what each
phase reports.

    the rollout phase   its own counts (dynamic sampling's rounds, groups dropped for balance),
                        the engine's timing (``EngineTiming``), the graded rollouts
    the graders         rewards, correctness, jargon, language share, the verifier's labels,
                        rollouts it ran out of time on
    the update phase    loss, ratios, gradient norm, log-prob gap, its parts' seconds
    the step            seconds of each phase, tokens per second, optimizer offload, peak memory

On W processes the row is reduced over ranks (``distributed.reduce_metrics``), and the verifier's
labels are summed over ranks before dividing. docs/metrics.md says what each metric means.
"""

from __future__ import annotations

import time

import torch

from tandem_lit.evaluation.language import LanguageShare
from tandem_lit.evaluation.metrics import JargonDetector, rollout_stats
from tandem_lit.evaluation.report import merge_totals
from tandem_lit.rollout.engine import EngineTiming
from tandem_lit.rollout.result import RolloutResult
from tandem_lit.training.distributed import reduce_metrics
from tandem_lit.training.memory import MemoryEstimate
from tandem_lit.verifiers.base import Verifier, label_means

GIB = 1024**3


def engine_phases(timing: EngineTiming | None) -> dict[str, float]:
    """A step's engine phases as train metrics (summed over its ``generate`` calls; none for an
    engine that does not time them)."""
    if timing is None:
        return {}
    calls = max(timing.calls, 1)
    phases = {
        "rollout_setup_seconds": timing.setup_s,
        "rollout_prefill_seconds": timing.prefill_s,
        "rollout_decode_seconds": timing.decode_s,
        "decode_step_ms": timing.decode_step_ms,
        "rollout_prompt_width": timing.prompt_width / calls,
    }
    # continuous batching: the share of decoded row-steps that wrote a token, and the rows that
    # wrote one in a mean decode step (against rollout.batch_size: how far the batch drained)
    if timing.busy_slot_fraction is not None:
        phases["rollout_busy_slot_fraction"] = timing.busy_slot_fraction / calls
    if timing.written_tokens is not None:
        phases["rollout_mean_live_rows"] = timing.written_tokens / max(timing.decode_steps, 1)
    # ... its refills: prefills of queued sequences into freed rows, and the sequences they admitted
    if timing.refilled_sequences is not None:
        phases.update(rollout_refills=timing.refills, rollout_refilled_sequences=timing.refilled_sequences)
    phases["rollout_decode_steps"] = timing.decode_steps
    # ... and the rate its decode read weights and caches at (set it beside the card's bandwidth)
    if timing.decode_read_tb_per_s is not None:
        phases["rollout_decode_read_tb_per_s"] = timing.decode_read_tb_per_s
    # ... and its paged pool: sequences preempted when it filled, the tokens they prefilled to go on
    if timing.preemptions is not None:
        phases.update(rollout_preemptions=timing.preemptions, rollout_resumed_tokens=timing.resumed_tokens,
                      rollout_kv_pool_peak_fraction=timing.kv_pool_peak_fraction / calls,
                      rollout_prefill_positions=timing.prefill_positions,
                      rollout_prefill_padded_positions=timing.prefill_padded_positions)
    # ... and partial rollouts' kept caches: positions that went to host memory, and came back
    if timing.kept_positions or timing.restored_positions:
        phases.update(rollout_kept_positions=timing.kept_positions, rollout_keep_seconds=timing.keep_s,
                      rollout_restored_positions=timing.restored_positions)
    return phases


class StepMetrics:
    """One training step's row: ``start`` when the step starts, ``rolled_out`` when its rollouts
    (and the optimizer state's return) are done, ``row`` after the update.

    ``count_skipped``: report ``skipped_long_prompts`` (``rollout.max_prompt_tokens`` is set);
    ``offload``: report ``optimizer_offload_seconds`` (``memory.offload_optimizer``)."""

    def __init__(self, verifier: Verifier, jargon: JargonDetector, language: LanguageShare | None,
                 count_skipped: bool, offload: bool):
        self.verifier, self.jargon, self.language = verifier, jargon, language
        self.count_skipped, self.offload = count_skipped, offload
        self.started = self.generated = 0.0
        self.timeouts: int | None = None
        self.rollout_peak = 0  # bytes, torch's allocator, on a GPU
        self.plan: MemoryEstimate | None = None  # the step's memory plan, once fit made it on a GPU

    def start(self, device: torch.device) -> None:
        self.started = time.perf_counter()
        # graded 0 because the grader ran out of time (or could not decide): verifiers that count them
        self.timeouts = getattr(self.verifier, "timeouts", None)
        if device.type == "cuda":  # each phase's own peak, to set beside the memory plan's
            torch.cuda.reset_peak_memory_stats(device)

    def rolled_out(self, device: torch.device) -> None:
        self.generated = time.perf_counter()
        if device.type == "cuda":
            self.rollout_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def row(self, result: RolloutResult | None, rollout: dict[str, float], update: dict[str, float] | None,
            timing: EngineTiming | None, tokenizer, skipped: int, offload_seconds: float, device: torch.device,
            world: int) -> dict[str, float]:
        """``train/``-prefixed metrics of the step: ``rollout`` the rollout phase's own counts,
        ``update`` ``UpdatePhase.run``'s (None: no update), ``timing`` the engine's, ``skipped``
        the prompts over ``max_prompt_tokens``, ``offload_seconds`` the optimizer state's moves."""
        stats = dict(rollout)
        if self.count_skipped:
            stats["skipped_long_prompts"] = float(skipped)
        if result is None:
            stats["skipped_update"] = 1.0
        else:
            stats.update(rollout_stats(result.rollout, result.rewards, result.correct, result.group, self.jargon))
            if self.language is not None:  # of the whole text and of each author's own words
                spans = [result.rollout.spans(i, tokenizer) for i in range(len(result.rollout.texts))]
                stats.update(self.language.stats(spans))
            stats.update(update or {})
            stats["tokens_per_second"] = float(result.rollout.lengths.sum()) / max(self.generated - self.started, 1e-9)
        now = time.perf_counter()
        stats["rollout_seconds"] = self.generated - self.started
        stats["update_seconds"] = now - self.generated
        stats["step_seconds"] = now - self.started  # (the CLI's step, to set beside benchmarks/train_step.py's)
        stats.update(engine_phases(timing))
        if self.timeouts is not None:
            stats["grader_timeouts"] = float(self.verifier.timeouts - self.timeouts)
        if self.offload:
            stats["optimizer_offload_seconds"] = offload_seconds
        if device.type == "cuda":  # torch's allocator (the plan's fixed overhead is outside it)
            update_peak = torch.cuda.max_memory_allocated(device)
            stats.update(rollout_peak_memory_gb=self.rollout_peak / GIB, update_peak_memory_gb=update_peak / GIB,
                         peak_memory_gb=max(self.rollout_peak, update_peak) / GIB)
            if self.plan is not None:
                stats.update({f"{phase}_memory_plan_gb": held / GIB for phase, held in self.plan.allocated().items()})
        # the verifier's labels (elegance, tests passed...): means over the grades that carry them,
        # summed over ranks before dividing (ranks hold different numbers of, e.g., correct solutions)
        labels = {name: [mean * count, count] for name, (mean, count) in label_means(result.grades).items()} if result else {}
        if world > 1:
            labels, stats = merge_totals(labels), reduce_metrics(stats)
        stats.update({name: total / count for name, (total, count) in labels.items()})
        return {f"train/{name}": value for name, value in stats.items()}
