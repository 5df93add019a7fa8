"""The update phase of a training step: graded rollouts in, optimiser updates of the senior out.

    rewards (overlong policy applied) -> advantages (the objective's)
    -> old log-probs (only when a step makes several updates, and only for the mini-batches
       after the first: the first one's are its own forward's) and reference log-probs (KL)
    -> per PPO mini-batch: micro-batches (rows, and tokens) -> teacher-forced log-probs
       -> objective loss -> backward; then clip, refuse a non-finite gradient, step

The rollout-vs-train log-prob gap is measured on the way (``train/rollout_logp_gap_*``), and the
time of each part (``train/update_{logprob,passes,optimizer}_seconds``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from tandem_lit.errors import ConfigError, LogprobGapError, NonFiniteGradientError
from tandem_lit.evaluation.metrics import LogprobGap
from tandem_lit.models import liger
from tandem_lit.models.varlen_attention import varlen_during
from tandem_lit.objectives.base import Objective, ObjectiveInputs
from tandem_lit.objectives.mismatch import MismatchStats
from tandem_lit.rollout.logprobs import completion_logprobs
from tandem_lit.rollout.record import Author, Rollout
from tandem_lit.rollout.result import RolloutResult
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.weights import plain_model
from tandem_lit.training.compute_weights import ComputeWeights, autocast_dtype
from tandem_lit.training.distributed import all_reduce_sum, balance, full_value, max_over_ranks
from tandem_lit.training.offload import OptimizerOffload
from tandem_lit.training.passes import pack_by_tokens
from tandem_lit.training.settings import MemorySettings, UpdateSettings

log = logging.getLogger(__name__)


class PhaseClock:
    """Seconds spent in each part of an update, the device synchronised at every mark so that a
    part is charged with its own kernels (a few marks per update: nothing beside its passes)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.last = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def charge(self, part: str) -> None:
        """The time since the last mark goes to ``part``."""
        now = self.now()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        return {f"update_{part}_seconds": seconds for part, seconds in self.seconds.items()}


def without_dropout(model: nn.Module) -> nn.Module:
    """``model`` with every dropout rate set to 0 (TRL's ``disable_dropout``; verl trains LoRA with
    dropout 0): the old log-probs, the training forward and the rollout-vs-train gap must all see
    one network, or the importance ratio of a token measures two dropout masks, not two policies
    (at LoRA dropout 0.5 two no-grad passes differed by up to 0.48 nats). The rates are zeroed,
    not the modules put in eval mode: Lightning sets train mode again around validation, and eval
    mode would also switch off Hugging Face's gradient checkpointing, which checks ``training``.
    Covers ``nn.Dropout`` modules (LoRA's ``lora_dropout``, GPT-2's) and the attention dropout
    rate Hugging Face attention layers keep as a float (``attention_dropout``)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


def row_index(rows: list[int], device: torch.device) -> Tensor:  # -> [len(rows)] long
    """``rows`` as an index tensor on ``device`` without a sync: a plain ``torch.tensor(rows,
    device=cuda)`` copies from pageable memory and waits for the stream, i.e. for every pass
    queued before it; a pinned buffer copies asynchronously."""
    index = torch.tensor(rows, dtype=torch.long)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def fresh_authors(rollout: Rollout) -> Tensor:  # -> [N, T]
    """The rollout's author codes with its stale tokens (partial rollouts: written by older
    weights) as padding: the engine-vs-trainer gap and mismatch measure the fresh tokens only
    (a stale token's gap is the policy's move since, which the stale correction weighs)."""
    if rollout.staleness is None:
        return rollout.author
    return torch.where(rollout.staleness > 0, int(Author.PAD), rollout.author.long()).to(rollout.author.dtype)


@dataclasses.dataclass
class HostRows:
    """Each row's prompt length, completion length and group, read to the host once per update:
    the passes are cut and trimmed from these, so that building a pass needs no device sync."""

    prompt: list[int]
    completion: list[int]
    group: list[int]
    prompt_width: int
    device: torch.device

    @classmethod
    def of(cls, rollout: Rollout, group: Tensor | None = None) -> HostRows:
        rows = rollout.completion_ids.shape[0]
        group = torch.zeros(rows, dtype=torch.long) if group is None else group
        columns = torch.stack([rollout.prompt_mask.sum(-1).long().cpu(), rollout.lengths.long().cpu(), group.long().cpu()])
        prompt, completion, groups = columns.tolist() if rows else ([], [], [])
        return cls(prompt, completion, groups, rollout.prompt_ids.shape[1], rollout.completion_ids.device)

    def trimmed(self, rollout: Rollout, micro: Tensor, rows: list[int]) -> Rollout:
        """``rollout.select(micro).trimmed()`` for the ``rows`` that ``micro`` holds, from the host's lengths."""
        first = self.prompt_width - max(self.prompt[i] for i in rows)
        width = max(max(self.completion[i] for i in rows), 1)
        return rollout.select(micro, rows).trimmed(first, width)

    def lengths(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """The prompt and completion lengths of ``rows`` (what a packed pass is laid out by)."""
        return [self.prompt[i] for i in rows], [self.completion[i] for i in rows]


class UpdatePhase:
    """Optimiser updates of the senior from one batch of graded rollouts.

    ``bind`` gives it, once: ``senior`` the trained model, ``reference`` the frozen initial copy
    for a KL term (None: the senior with its LoRA adapters disabled), ``backward`` Lightning's
    ``manual_backward``, ``vocab`` the engine's sampled vocabulary.
    """

    def __init__(self, settings: UpdateSettings, memory: MemorySettings, objective: Objective, sampling: SamplingConfig):
        self.settings = settings
        self.memory = memory
        self.objective = objective
        self.sampling = sampling
        self.offload = OptimizerOffload() if memory.offload_optimizer else None
        self.warned_gap = False
        self.fused_kernels: tuple[str, ...] = ()  # Liger's in use (memory.fused_kernels), decided when fit starts
        self.fused_logprobs = False  # the fused head among them
        self.vocab: int | None = None  # the engine's sampled vocabulary (RolloutEngine.sampled_vocab), set by bind

    def bind(self, senior: nn.Module, reference: nn.Module | None, backward: Callable[[Tensor], None],
             vocab: int | None = None) -> None:
        """The models and the backward once loaded; ``vocab``: the logits the engine samples from
        (the update's log-probs normalise over the same ones). The models' dropout is switched off
        for good (``without_dropout``): every pass of an update scores the same network."""
        self.senior, self.reference, self.backward, self.vocab = senior, reference, backward, vocab
        for model in (senior, reference):
            if model is not None:
                without_dropout(model)

    def make_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None) -> torch.optim.Optimizer:
        """The optimiser over the senior's trainable parameters: ``factory``'s (the config's
        ``optimizer``), else AdamW at lr 1e-6 without weight decay. torch.optim's checks of its
        arguments (a negative lr, betas outside [0, 1)) end in one line."""
        params = [p for p in self.senior.parameters() if p.requires_grad]
        if factory is None:
            return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
        try:
            return factory(params)
        except ValueError as err:
            raise ConfigError(f"the optimizer refused its settings: {err}. Fix model.init_args.optimizer.init_args "
                              "(--print_config shows them).") from None

    def check_group_size(self) -> None:
        """A group-relative objective needs several rollouts per prompt (checked when fit starts)."""
        if self.objective.group_relative and self.sampling.n < 2:
            raise ConfigError(
                f"{type(self.objective).__name__} compares the rollouts of each prompt, and rollout.sampling.n is "
                f"{self.sampling.n}: every advantage would be 0 and nothing would train. Set rollout.sampling.n >= 2 "
                "(Tandem RLVR uses 8), or use Reinforce."
            )

    def use_fused_kernels(self, device: torch.device) -> tuple[str, ...]:
        """Liger's kernels (``memory.fused_kernels``) in the forward of the senior and of its
        reference copy (so that a KL term starts at 0), never the junior's or the engine's; the
        kernels in use (none: PyTorch's, said once in the log)."""
        kernels = liger.resolve(self.memory.fused_kernels, self.senior, device)
        for model in (self.senior, self.reference):
            if model is not None:
                liger.apply_liger(model, kernels)
        self.fused_kernels, self.fused_logprobs = kernels, "logprobs" in kernels
        return kernels

    def run(self, result: RolloutResult, optimizer, device: torch.device, world: int = 1, step: int = 0) -> dict[str, float]:
        """The objective and the optimiser updates (one per mini-batch) on one batch of graded
        rollouts; returns the update's metrics. ``step``: the optimiser updates so far (for errors).
        Packed passes (``memory.pack_sequences``) run an ``sdpa`` senior's attention through the
        variable-length flash kernel for the whole update (``models.varlen_attention``)."""
        packed = self.memory.pack_sequences
        models = [plain_model(m) for m in (self.senior, self.reference) if m is not None] if packed else []
        with varlen_during(models, device):
            return self._run(result, optimizer, device, world, step)

    def _run(self, result: RolloutResult, optimizer, device: torch.device, world: int, step: int) -> dict[str, float]:
        clock = PhaseClock(device)
        rollout, group = result.rollout, result.group.to(device)
        rewards = result.rewards.to(device)
        truncated = rollout.truncated.to(device)
        overlong = self.settings.overlong
        rewards = overlong.rewards(rewards, rollout.lengths, truncated, self.sampling.max_new_tokens)
        allowed = ~truncated if overlong.mode == "mask" else None
        # what the passes are cut by, on the host once (``HostRows``): the passes then queue on
        # the GPU back to back, with no sync between them but the one Liger's head makes
        host = HostRows.of(rollout, result.group)
        prompts = max(host.group) + 1
        # with W ranks each holds 1/W of every mini-batch (``rank_rows``)
        per_update = self.settings.mini_batch_size // world if self.settings.mini_batch_size else prompts
        updates = [[i for i, g in enumerate(host.group) if s <= g < s + per_update] for s in range(0, prompts, per_update)]
        over_ranks = (lambda values: all_reduce_sum(values, device)) if world > 1 else None
        advantages = self.objective.advantages(rewards, group, over_ranks)
        # the ratio's denominator comes from the training model before this step's first update.
        # The first mini-batch's is its own forward's log-probs, detached (no update has happened
        # yet: with one update that is all of them); the later mini-batches' are computed here,
        # before the first update changes the weights. Geometric-mean sequence masking decides
        # which rows enter a mini-batch's normaliser from them, so it needs the first one's too
        masks = self.objective.masks_sequences
        later = [i for rows in updates[1:] for i in rows] if len(updates) > 1 else None
        scored = list(range(len(host.group))) if masks else later  # rows whose old log-probs come first
        needs_old = self.objective.uses_old_logp or masks
        with self.compute_weights(device, world):
            old_logp = self.behaviour_logprobs(rollout, device, scored, world, host) if needs_old and scored is not None else None
            ref_logp = self.reference_logprobs(rollout, device, world, host) if self.objective.uses_reference else None
        clock.charge("logprob")  # forward-only passes: the old and the reference log-probs
        gap, mismatch = LogprobGap(), MismatchStats()  # the engine's log-probs against the old ones
        if old_logp is not None and rollout.senior_logprobs is not None:
            scored_rows = row_index(scored, device)
            for measure in (gap, mismatch):
                measure.add(old_logp[scored_rows], rollout.senior_logprobs[scored_rows], fresh_authors(rollout)[scored_rows])
        totals: dict[str, Tensor | float] = {}  # metrics summed on the device, read once at the end
        if masks:
            rejected = self.objective.rejected(old_logp, rollout.senior_logprobs, rollout.author)
            allowed = ~rejected if allowed is None else allowed & ~rejected
            totals["geo_masked_fraction"] = rejected.float().mean()
        for index, update_rows in enumerate(updates):
            rows = row_index(update_rows, device)
            mask = allowed[rows] if allowed is not None else None
            scale = self.objective.loss_scale(rollout.author[rows], advantages[rows], self.sampling.max_new_tokens, mask)
            passes = self.passes(host, update_rows, world)
            if world > 1:  # normalisers of the whole mini-batch
                weight_sum, sequences = all_reduce_sum([scale.weight_sum, scale.sequences], device)
                scale = dataclasses.replace(scale, weight_sum=weight_sum, sequences=int(sequences))
            optimizer.zero_grad(set_to_none=True)
            with self.compute_weights(device, world):  # once per update: the weights change after it
                for pass_rows in passes:
                    micro = row_index(pass_rows, device)
                    part = host.trimmed(rollout, micro, pass_rows)
                    width = part.completion_ids.shape[1]
                    logp = self.sequence_logprobs(self.senior, part, lengths=host.lengths(pass_rows))
                    own = old_logp is None or (index == 0 and not masks)  # the old log-probs are this forward's
                    if own:
                        gap.add(logp, part.senior_logprobs, fresh_authors(part))
                        mismatch.add(logp, part.senior_logprobs, fresh_authors(part))
                    old = None
                    if old_logp is not None:
                        old = logp.detach() if own else old_logp[micro, :width]
                    inputs = ObjectiveInputs(
                        logp=logp,
                        author=part.author,
                        rewards=rewards[micro],
                        group=group[micro],
                        old_logp=old,
                        ref_logp=ref_logp[micro, :width] if ref_logp is not None else None,
                        advantages=advantages[micro],
                        mask=allowed[micro] if allowed is not None else None,
                        rollout_logp=part.senior_logprobs,
                        stale=part.staleness > 0 if part.staleness is not None else None,
                    )
                    loss, metrics = self.objective.loss_and_metrics(inputs, scale)
                    self.backward(loss * world)  # FSDP averages gradients over ranks
                    # micro-batch losses add up to the update's loss; other metrics are row averages
                    totals["loss"] = totals.get("loss", 0.0) + metrics.pop("loss") / len(updates)
                    for name, value in metrics.items():
                        totals[name] = totals.get(name, 0.0) + value * len(micro) / len(group)
            clock.charge("passes")  # forward + backward
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + self.clipped_norm(optimizer, step) / len(updates)
            if index == 0:
                self.check_logp_gap_limit(gap, optimizer, device, world)
            optimizer.step()
            clock.charge("optimizer")  # clipping and the step
        optimizer.zero_grad(set_to_none=True)  # no gradient memory held through the next rollouts
        names = list(totals)
        totals = dict(zip(names, torch.stack([torch.as_tensor(totals[n], device=device, dtype=torch.float32)
                                              for n in names]).cpu().tolist())) if names else {}
        totals["updates"] = float(len(updates))
        totals.update(gap.metrics())
        totals.update(mismatch.metrics())
        totals.update(clock.metrics())
        self.check_logp_gap(totals)
        return totals

    def check_logp_gap(self, metrics: dict[str, float]) -> None:
        """Say once per run when the engine's log-probs and the training forward's disagree by
        more than ``update.logp_gap_warning`` nats on average: every importance ratio is then off
        by about e^gap, far outside a 0.2 clip range, and the run clips most tokens without error."""
        gap, limit = metrics.get("rollout_logp_gap_mean"), self.settings.logp_gap_warning
        if self.warned_gap or gap is None or limit is None or gap <= limit:
            return
        self.warned_gap = True
        log.warning(
            "train/rollout_logp_gap_mean is %.3f nats (above update.logp_gap_warning=%s): the rollouts were "
            "sampled from a policy the update does not see, so importance ratios are off by ~x%.2f. Likely causes: "
            "a rollout copy in bf16 of an architecture sensitive to it (try the engine's rollout_dtype: float32 to "
            "check), different kernels on the two sides, or a stale weight sync. Set objective.tis_cap (verl uses "
            "2.0) to correct the ratios for it (docs/metrics.md says which values are normal).",
            gap, limit, math.exp(gap),
        )

    def check_logp_gap_limit(self, gap: LogprobGap, optimizer, device, world: int) -> None:
        """Stop before the first update when the mean gap (over every rank's tokens so far: the
        first mini-batch and the rows whose old log-probs were computed) exceeds
        ``update.logp_gap_limit``: the update is not applied."""
        limit = self.settings.logp_gap_limit
        if limit is None:
            return
        total, tokens, _ = gap.read()
        if world > 1:  # every rank decides on the same numbers: none waits in a collective alone
            total, tokens = all_reduce_sum([total, float(tokens)], device)
        if not tokens or total / tokens <= limit:
            return
        optimizer.zero_grad(set_to_none=True)
        mean = total / tokens
        raise LogprobGapError(
            f"the rollout engine's log-probs are {mean:.3f} nats from the training forward's on average (above "
            f"update.logp_gap_limit={limit:g}): every importance ratio would be off by ~x{math.exp(mean):.1f}, so "
            "this update was not applied. Check the engine's weight sync and dtype (rollout_dtype: float32 to "
            "compare), or set update.logp_gap_limit: null to train anyway (docs/metrics.md)"
        )

    def compute_weights(self, device: torch.device, world: int) -> ComputeWeights:
        """The senior's linear weights in autocast's dtype for the passes inside it, cast once
        (``memory.cast_weights_once``; one process: FSDP2 gathers its shards in bf16 already)."""
        dtype = autocast_dtype(device) if self.memory.cast_weights_once and world == 1 else None
        return ComputeWeights(self.senior, dtype)

    def clipped_norm(self, optimizer, step: int) -> float:
        """Clip the gradient; a non-finite norm stops the run before it reaches the weights."""
        params = [p for p in self.senior.parameters() if p.requires_grad]
        norm = float(full_value(torch.nn.utils.clip_grad_norm_(params, self.settings.max_grad_norm or math.inf)))
        if not math.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteGradientError(
                f"the gradient norm is {norm} at step {step}: this update was not applied and the "
                "run stops (resume from the last checkpoint). Look for "
                "non-finite rewards or log-probs; lower the learning rate, set max_grad_norm, or train "
                "with trainer.precision 32-true to see whether mixed precision causes it"
            )
        return norm

    def passes(self, host: HostRows, rows: list[int], world: int = 1, scale: int = 1) -> list[list[int]]:
        """The rows of one update in forward/backward passes of at most ``micro_batch_size`` rows
        (any number with ``memory.fill_passes``) and ``memory.micro_batch_tokens`` tokens, padded
        or packed (``memory.pack_by_tokens``), both bounds times ``scale`` (forward-only passes:
        ``memory.forward_only_pass_scale``). The gradient is a sum over rows: grouping does not
        change it. On ``world`` > 1 processes every rank gets as many passes as the busiest (FSDP
        gathers weights in each forward, trained or not: token-bounded passes differ in number
        between ranks whose rows differ in length, and a rank a pass short would leave the others
        waiting); the largest passes are split."""
        size = self.settings.micro_batch_size * scale
        if self.memory.micro_batch_tokens is None:
            passes = [rows[start : start + size] for start in range(0, len(rows), size)]
        else:
            if self.memory.fill_passes:
                size = len(rows)
            prompts, completions = [host.prompt[i] for i in rows], [host.completion[i] for i in rows]
            tokens = self.memory.micro_batch_tokens * scale
            packed = pack_by_tokens(prompts, completions, size, tokens, self.memory.pack_sequences)
            passes = [[rows[i] for i in b] for b in packed]
        return balance(passes, max_over_ranks(len(passes), host.device)) if world > 1 else passes

    # ------------------------------------------------------------------------------ log-probs

    def sequence_logprobs(self, model: nn.Module, rollout: Rollout, temperature: float | None = None,
                          lengths: tuple[list[int], list[int]] | None = None) -> Tensor:  # -> [N, T]
        """Log-probs of the completion tokens under ``model`` (teacher-forced, one forward).

        Logits are divided by the sampling temperature, as the sampler drew from that
        distribution (the TRL / verl convention), so importance ratios compare like with like.
        ``memory.pack_sequences``: the rows run packed into one row (``rollout.logprobs``);
        ``fused_logprobs``: through Liger's fused head, for the senior and its reference alike.
        Normalised over the engine's sampled vocabulary (``vocab``), as the engine's own log-probs.
        ``lengths``: the rows' prompt and completion lengths on the host (``HostRows.lengths``), which
        a packed pass is laid out by without reading the device.
        """
        temperature = self.sampling.temperature if temperature is None else temperature
        return completion_logprobs(model, rollout, temperature, packed=self.memory.pack_sequences, fused=self.fused_logprobs,
                                   vocab=self.vocab, lengths=lengths)

    @torch.no_grad()
    def behaviour_logprobs(self, rollout: Rollout, device: torch.device, rows: list[int] | None = None,
                           world: int = 1, host: HostRows | None = None) -> Tensor:  # -> [N, T]
        """Senior log-probs before any update of this step (the ratio's denominator), of ``rows``
        (None: all; other rows stay 0)."""
        return self.logprobs_by_rows(rollout, device, lambda part, lengths: self.sequence_logprobs(self.senior, part, lengths=lengths),
                                     rows, world, host)

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout, device: torch.device, world: int = 1,
                           host: HostRows | None = None) -> Tensor:  # -> [N, T]
        """Log-probs under the reference policy: the initial senior (LoRA disabled, or a frozen copy)."""
        if self.reference is not None:
            return self.logprobs_by_rows(rollout, device, lambda part, lengths: self.sequence_logprobs(self.reference, part, lengths=lengths),
                                         world=world, host=host)
        with self.senior.disable_adapter():
            return self.logprobs_by_rows(rollout, device, lambda part, lengths: self.sequence_logprobs(self.senior, part, lengths=lengths),
                                         world=world, host=host)

    def logprobs_by_rows(
        self, rollout: Rollout, device: torch.device, logprobs: Callable[[Rollout, tuple[list[int], list[int]]], Tensor],
        rows: list[int] | None = None,
        world: int = 1, host: HostRows | None = None,
    ) -> Tensor:  # -> [N, T]
        """``logprobs`` of ``rows`` (None: the whole batch) in forward-only passes
        (``memory.forward_only_pass_scale`` times a training pass), padding columns trimmed per
        pass; other rows stay 0. ``world``: as ``passes``."""
        host = host or HostRows.of(rollout)
        if rows is None:
            rows = list(range(len(host.prompt)))
        out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=device)
        for pass_rows in self.passes(host, rows, world, scale=self.memory.forward_only_pass_scale):
            micro = row_index(pass_rows, device)
            part = logprobs(host.trimmed(rollout, micro, pass_rows), host.lengths(pass_rows))
            out[micro, : part.shape[1]] = part.float()
        return out

    # ------------------------------------------------------------------------- optimizer state

    def offload_optimizer_state(self, optimizer, device: torch.device) -> float:
        """Optimizer state to the host for the rollouts (``memory.offload_optimizer``); seconds taken."""
        started = time.perf_counter()
        if self.offload is not None and device.type == "cuda":
            self.offload.to_host(optimizer)
        return time.perf_counter() - started

    def restore_optimizer_state(self, optimizer) -> float:
        started = time.perf_counter()
        if self.offload is not None:
            self.offload.to_device(optimizer)
        return time.perf_counter() - started
