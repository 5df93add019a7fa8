"""Rollout engines: both models extend one shared sequence; the engine returns a Rollout.

``RolloutEngine`` is the interface. ``HFEngine`` is the reference implementation: an eager
loop over Hugging Face forwards with dynamic KV caches. It runs any causal LM (LoRA-wrapped
included) and is the baseline the fast engine is measured against.

Every engine decodes the senior from its rollout weights (``tandem_lit.rollout.weights``): a
plain copy in the rollout dtype (bf16 on a GPU), LoRA merged, refreshed through
``load_weights(named_tensors)`` after the optimiser moves the trained weights; or, when decoding
the trained weights needs no conversion (same dtype, no adapters) or ``rollout_dtype: live``, the
trained model itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem_lit.errors import ConfigError, TokenizerMismatchError
from tandem_lit.rollout.decoder import TandemDecoder
from tandem_lit.rollout.handoff import HandoffPolicy, TokenClasses
from tandem_lit.rollout.record import Author, PromptBatch, Rollout, StopRule
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.weights import (
    build_rollout_copy,
    check_rollout_dtype,
    is_sharded,
    load_named_tensors,
    needs_copy,
    rollout_dtype,
    rollout_named_tensors,
)


def check_shared_tokenizer(senior_tokenizer, junior_tokenizer) -> None:
    """Token-level lockstep needs one vocabulary: same token for the same id, same end token."""
    if junior_tokenizer is None or junior_tokenizer is senior_tokenizer:
        return
    fix = (
        "Token-level handoff feeds every token to both models, so they must share a tokenizer. "
        "Use a junior with the senior's tokenizer, or set the engine to TextHandoffEngine for "
        "text-level handoff between different tokenizers."
    )
    if senior_tokenizer.get_vocab() != junior_tokenizer.get_vocab():
        raise TokenizerMismatchError(
            f"senior and junior tokenizers differ ({len(senior_tokenizer)} vs {len(junior_tokenizer)} "
            f"tokens, or the same size with different ids). {fix}"
        )
    if senior_tokenizer.eos_token_id != junior_tokenizer.eos_token_id:
        raise TokenizerMismatchError(
            f"senior and junior tokenizers end sequences with different tokens "
            f"({senior_tokenizer.eos_token_id} vs {junior_tokenizer.eos_token_id}). {fix}"
        )


def check_max_batch(max_batch: int | None) -> int | None:
    if max_batch is not None and max_batch < 1:
        raise ConfigError(f"max_batch (rollout.batch_size) must be >= 1, or None for all rows at once, got {max_batch}")
    return max_batch


def end_token_ids(tokenizer, model: nn.Module | None = None) -> list[int]:
    """Every token id that ends a completion: the tokenizer's and the generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if not ids:
        raise ConfigError("the tokenizer has no end-of-sequence token: set tokenizer.eos_token before training")
    return sorted(ids)


@contextlib.contextmanager
def eval_mode(*models: nn.Module | None):
    """Generation without dropout; restores each model's train/eval mode afterwards."""
    present = [m for m in models if m is not None]
    modes = [m.training for m in present]
    for m in present:
        m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, was_training in zip(present, modes):
            m.train(was_training)


@dataclass
class EngineTiming:
    """Where ``generate`` calls spent their time. An engine reports one call (``calls`` 1); ``+``
    sums calls, so a rollout phase of several calls is one ``EngineTiming`` too. Per-call ratios
    and widths (``prompt_width``, ``busy_slot_fraction``, ``kv_pool_peak_fraction``) are summed
    as well: divide by ``calls`` for their mean. None: not reported by this engine (the ones a
    continuous-batching engine or its paged KV pool report)."""

    setup_s: float = 0.0  # cache allocation, graph capture, waking a sleeping engine
    prefill_s: float = 0.0  # prefills the decode waited for (and any run beside a decode chunk)
    decode_s: float = 0.0  # decode steps, prefills beside them included
    decode_steps: int = 0
    prompt_width: int = 0  # the widest padded prompt
    calls: int = 1
    # continuous batching (FastEngine): prefills run beside decode chunks (part of prefill_s),
    # tokens written over the row-steps paid for, the tokens written (over decode_steps: the mean
    # live rows), refills of freed rows and the sequences they admitted, compactions of live rows
    # into a smaller captured batch
    prefill_beside_s: float | None = None
    busy_slot_fraction: float | None = None
    written_tokens: int | None = None
    refills: int | None = None
    refilled_sequences: int | None = None
    compactions: int | None = None
    # a paged KV pool: sequences preempted when it filled, the response tokens they prefilled again
    # to go on, the token positions it holds and the most of it held at once
    preemptions: int | None = None
    resumed_tokens: int | None = None
    # ... and its prefills: the positions their forwards ran over (prompts, and the tokens of resumed
    # sequences), and as many padded (each prefill's rows x its widest: the compute they cost)
    prefill_positions: int | None = None
    prefill_padded_positions: int | None = None
    # FastEngine's decode: the bytes its steps read (each active model's weights once a step, and
    # the keys and values of the cache positions its attention read; None for Qwen3.5's hybrid
    # layers), over ``decode_s`` the rate it read them at, beside the card's bandwidth
    decode_read_bytes: int | None = None
    # partial rollouts with ``keep_caches``: positions of the paused sequences whose pages went to
    # host memory and the seconds that took (not in decode_s), and of the resumed ones whose pages
    # came back (not prefilled again; the copies are in prefill_s)
    kept_positions: int | None = None
    keep_s: float | None = None
    restored_positions: int | None = None
    kv_pool_tokens: int | None = None
    kv_pool_peak_fraction: float | None = None

    @property
    def decode_step_ms(self) -> float:
        return 1000 * self.decode_s / max(self.decode_steps, 1)

    @property
    def decode_read_tb_per_s(self) -> float | None:
        return None if self.decode_read_bytes is None or self.decode_s <= 0 else self.decode_read_bytes / self.decode_s / 1e12

    def __add__(self, other: EngineTiming) -> EngineTiming:
        def add(a, b):
            return b if a is None else a if b is None else a + b

        return EngineTiming(**{f.name: add(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        """The reported fields by name (and ``decode_step_ms``), for benchmark rows and logs."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return {**out, "decode_step_ms": self.decode_step_ms}


@dataclass
class KVBudget:
    """What a training run's memory plan gives the rollout phase's KV caches, handed to
    ``RolloutEngine.plan_kv_cache`` once, before ``setup``."""

    planned_tokens: int  # token positions the plan counts (rollout.batch_size sequences x their caps, or the engine's own pool)
    bytes_per_token: int  # both models' K/V of one token position
    fitting_tokens: int | None = None  # positions that fit the device beside the rest of the rollout phase (None: no device to fit)
    # (pool positions, prefill positions) sized from the card and the plan, given the engine's
    # prefill size (``kv_cache_gib: auto``); None: no device to fit
    size_for_card: Callable[[int], tuple[int, int]] | None = None

    @property
    def planned_bytes(self) -> int:
        return self.planned_tokens * self.bytes_per_token


class RolloutEngine(ABC):
    """Generates tandem rollouts: the contract between an engine and training.

    An engine implements ``generate`` (abstract); everything else here has a default that serves
    an engine without a cache of its own (``HFEngine``). Training uses exactly what is declared on
    this class, and nothing else (``training.rollout_phase.RolloutPhase`` owns an engine's life):

    - once per device: ``plan_kv_cache`` (a training run's KV budget, before setup), ``setup``
      (binds the models and tokenizers, and ``max_batch`` = ``rollout.batch_size``);
    - per rollout call: ``generate``, then ``last_timing``;
    - after optimiser updates: ``load_weights`` when ``decodes_copy``; before the update: ``release``;
    - read: ``senior`` (what the engine decodes: its rollout copy, or the trained model when that
      needs no conversion), ``trained_senior`` (the model the optimiser updates), ``junior``,
      ``tokenizer``, ``eos_token_ids``, ``pad_token_id``, ``sampled_vocab``, ``queues_rows``,
      ``needs_partner_prompts``, ``pauses``, ``rollout_dtype``, ``kv_pool_size``, ``kv_cache_bytes``.

    ``rollout_dtype``: ``auto`` (bf16 on a GPU that has it, else the trained weights' dtype),
    ``bfloat16``, ``float16``, ``float32``, or ``live`` (always decode the trained weights in place).
    """

    senior: nn.Module
    trained_senior: nn.Module
    junior: nn.Module | None
    tokenizer: object
    eos_token_ids: list[int]  # every token id that ends a completion (set by ``setup``)
    pad_token_id: int  # what pads completions (set by ``setup``)
    weights_version: int = 0  # ``load_weights`` calls since the senior was bound
    rollout_dtype: str = "auto"  # engines take it as an __init__ argument
    # True: one ``generate`` call may hold any number of rows (a step's whole batch); the engine
    # itself decodes at most ``max_batch`` of them at a time and refills freed room (FastEngine,
    # VLLMEngine). False: callers send at most ``max_batch`` rows per call (HFEngine).
    queues_rows: bool = False
    # Sequences decoded at once: ``rollout.batch_size``, given to ``setup`` (None: every row of a call)
    max_batch: int | None = None
    # True: ``generate`` reads ``PromptBatch.partner`` (the prompts in the junior's own tokens),
    # which the rollout phase then always builds (TextHandoffEngine)
    needs_partner_prompts: bool = False
    # True: ``generate`` takes ``stop`` (a ``StopRule``: end once enough prompt groups are complete,
    # the rows still running returned in ``Rollout.paused``) and goes on with paused sequences given
    # in ``PromptBatch.resume``, token for token as if never paused (``rollout.partial``)
    pauses: bool = False

    def why_no_kept_caches(self) -> str | None:
        """Why this engine cannot keep paused sequences' keys and values in host memory
        (``StopRule.keep_caches``, ``rollout.partial.keep_caches``); None: it can."""
        return f"{type(self).__name__} prefills a resumed sequence again and keeps no cache"

    def sampled_vocab(self, tokenizer) -> int | None:
        """How many of the senior head's logits the engine samples and scores tokens over (the
        first ones), reading ``tokenizer``; None: all of them. The token-level engines draw from the
        tokenizer's vocabulary (``TokenClasses``): a head's rows past it are padding no token id
        decodes to (Qwen3's 151,936 rows for 151,669 tokens). The update's log-probs normalise over
        the same tokens, so an importance ratio compares the distribution the token was drawn from;
        on random weights, where padding rows carry real mass, a mismatch would be a gap of
        log(rows / tokens) on every token."""
        return len(tokenizer)

    def kv_pool_size(self) -> tuple[int | None, float | None]:
        """The KV pool this engine holds whatever the batch, for the memory plan: (token positions,
        GiB), at most one set; (None, None): caches sized by the batch (rows x their tokens), as
        the plan counts them by default."""
        return None, None

    def prefill_size(self) -> int | None:
        """Padded positions one prefill holds in staging caches beside the engine's own, for the
        memory plan; None: the engine prefills into its caches directly."""
        return None

    def kv_cache_bytes(self) -> int | None:
        """Bytes of one cached key or value element, for the memory plan; None: the decoded
        model's own dtype (``FastEngine(kv_cache_dtype="fp8")``: 1). Not None: the cache rounds
        what the model computed, so training requires the objective's ``tis_cap`` (pre-flight)."""
        return None

    def plan_kv_cache(self, budget: KVBudget) -> str | None:
        """Size the engine's KV cache from a training run's memory plan (``budget``), before
        ``setup``; a line for the log saying what it chose, or None. Engines whose caches grow with
        the batch have nothing to plan."""
        return None

    def setup(self, senior: nn.Module, junior: nn.Module | None, tokenizer, junior_tokenizer=None,
              max_batch: int | None = None) -> None:
        """Bind the models and tokenizers (once per device); ``max_batch``: sequences decoded at
        once (``rollout.batch_size``; None: every row of a ``generate`` call)."""
        self.max_batch = check_max_batch(max_batch)
        check_shared_tokenizer(tokenizer, junior_tokenizer)
        self.bind_senior(senior)
        self.junior = junior
        self.tokenizer = tokenizer
        self.eos_token_ids = end_token_ids(tokenizer, senior)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self._classes: TokenClasses | None = None

    def bind_senior(self, trained: nn.Module) -> None:
        """Decode from a rollout copy of ``trained`` where its weights need converting (dtype,
        adapters, 4-bit base), else from ``trained`` itself."""
        self.trained_senior = self.senior = trained
        self.weights_version = 0
        if self.rollout_dtype == "live":
            if is_sharded(trained):
                raise ConfigError("rollout_dtype: live decodes the trained weights in place, and FSDP shards them: "
                                  "use rollout_dtype: auto (a copy filled from the gathered shards)")
            return
        dtype = rollout_dtype(self.rollout_dtype, trained)
        if needs_copy(trained, dtype) or is_sharded(trained):  # (sharded: bound inside ``gathered``)
            self.senior = build_rollout_copy(trained, dtype)
            load_named_tensors(self.senior, rollout_named_tensors(trained))

    @property
    def decodes_copy(self) -> bool:
        """True when the engine decodes its own copy, which ``load_weights`` must refresh."""
        return self.senior is not self.trained_senior

    def load_weights(self, named_tensors) -> int:
        """Load (name, tensor) pairs, in the plain model's parameter names, into the rollout copy;
        they must cover it exactly. The seam every weight producer uses (one process: the module's
        ``rollout_named_tensors``; sharded training: gathered shards). Returns the count loaded."""
        if not self.decodes_copy:
            raise ConfigError("this engine decodes the trained senior in place (no rollout copy): nothing to load")
        loaded = load_named_tensors(self.senior, named_tensors)
        self.weights_version += 1
        return loaded

    def release(self) -> None:  # noqa: B027 (engines with dynamic caches hold nothing between calls)
        """Free generation memory (caches, captured graphs) until the next ``generate``."""

    def last_timing(self) -> EngineTiming | None:
        """Where the last ``generate`` spent its time; None: this engine does not time its calls."""
        return None

    def token_classes(self, device: torch.device) -> TokenClasses:
        if self._classes is None or self._classes.starts_ws.device != device:
            self._classes = TokenClasses.from_tokenizer(self.tokenizer, device)
        return self._classes

    def decoder(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig) -> TandemDecoder:
        """A fresh decoder loaded with this batch's seeds."""
        self.check_models(policy)
        decoder = TandemDecoder(
            policy, self.token_classes(prompts.seeds.device), sampling, prompts.batch_size,
            self.eos_token_ids, self.pad_token_id,
        )
        decoder.reset(prompts.seeds, prompts.budgets(sampling.max_new_tokens))
        return decoder

    def check_models(self, policy: HandoffPolicy) -> None:
        if policy.only_author != Author.SENIOR and self.junior is None:
            raise ConfigError(f"{policy!r} needs a junior model, but none is configured")

    @abstractmethod
    def generate(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig,
                 stop: StopRule | None = None) -> Rollout:
        """Rollouts for a batch of prompts (one row per rollout). ``stop`` and ``prompts.resume``
        (partial rollouts) are given only to an engine that ``pauses``: it ends the call once
        ``stop`` is reached, the rows still running in ``Rollout.paused``."""


def with_responses(ids: Tensor, mask: Tensor, responses: list[Tensor | None]) -> tuple[Tensor, Tensor]:
    """Left-padded prompts [n, W] with each row's response tokens (None: none) appended after its
    prompt, left-padded again to one width: what a resumed sequence prefills."""
    lengths = [0 if r is None else r.numel() for r in responses]
    extra = max(lengths)
    out_ids = torch.zeros((ids.shape[0], ids.shape[1] + extra), dtype=ids.dtype, device=ids.device)
    out_mask = torch.zeros_like(out_ids, dtype=mask.dtype)
    for i, (response, n) in enumerate(zip(responses, lengths)):
        lead = extra - n
        out_ids[i, lead : lead + ids.shape[1]] = ids[i]
        out_mask[i, lead : lead + ids.shape[1]] = mask[i]
        if n:
            out_ids[i, lead + ids.shape[1]:] = response.to(ids.device)
            out_mask[i, lead + ids.shape[1]:] = 1
    return out_ids, out_mask


def model_prompts(prompts: PromptBatch) -> dict[str, tuple[Tensor, Tensor]]:
    """Each model's (input_ids, attention_mask), left-padded to one width. The junior reads the
    batch's ``partner`` prompts when it carries them (its own system prompt or template; the
    response tokens stay shared), else the senior's."""
    senior = (prompts.input_ids, prompts.attention_mask)
    if prompts.partner is None:
        return {"senior": senior, "junior": senior}
    junior = (prompts.partner.input_ids.to(senior[0].device), prompts.partner.attention_mask.to(senior[0].device))
    width = max(senior[0].shape[1], junior[0].shape[1])

    def left_pad(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        extra = width - ids.shape[1]  # padding ids are masked out: any id in the vocabulary serves
        return F.pad(ids, (extra, 0), value=0), F.pad(mask, (extra, 0), value=0)

    return {"senior": left_pad(*senior), "junior": left_pad(*junior)}


class HFEngine(RolloutEngine):
    """Eager tandem loop over Hugging Face forwards with dynamic KV caches (any causal LM).

    Args:
        check_every: Look for all-finished batches every this many tokens (one host sync each).
        rollout_dtype: Dtype of the senior's rollout copy (see ``RolloutEngine``).
    """

    pauses = True

    def __init__(self, check_every: int = 1, rollout_dtype: str = "auto"):
        self.check_every = max(1, check_every)
        self.rollout_dtype = check_rollout_dtype(rollout_dtype)

    def generate(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig,
                 stop: StopRule | None = None) -> Rollout:
        """See ``RolloutEngine``. With ``stop``, the finished flags are read every ``check_every``
        steps, and the call ends once the rule is reached; resumed rows prefill their prompt and
        the tokens they wrote, then go on from their saved decoder state."""
        if stop is not None and stop.keep_caches:
            raise ConfigError(self.why_no_kept_caches())
        device = next(self.senior.parameters()).device
        prompts = prompts.to(device)
        inputs = model_prompts(prompts)
        decoder = self.decoder(prompts, policy, sampling)
        if prompts.resumes:
            back = [i for i, p in enumerate(prompts.resume) if p is not None and p.state is not None]
            decoder.resume(torch.tensor(back, device=device), [prompts.resume[i] for i in back])
            responses = [p.tokens if p is not None and p.state is not None else None for p in prompts.resume]
            inputs = {name: with_responses(ids, mask, responses) for name, (ids, mask) in inputs.items()}
        runners = {
            "senior": _CachedForward(self.senior) if decoder.needs_senior else None,
            "junior": _CachedForward(self.junior) if decoder.needs_junior else None,
        }
        stopped = False
        with eval_mode(self.senior, self.junior):
            logits = {name: r.prefill(*inputs[name]) if r else None for name, r in runners.items()}
            longest = int((decoder.budget - decoder.t).max())
            for t in range(longest):
                token = decoder.step(logits["senior"], logits["junior"])
                steps = t + 1
                if steps == longest or (steps % self.check_every == 0 and decoder.all_finished()):
                    break
                if stop is not None and steps % self.check_every == 0 and stop.reached(decoder.state.finished.tolist()):
                    stopped = True
                    break
                logits = {name: r.step(token) if r else None for name, r in runners.items()}
        rollout = decoder.finish(prompts, self.tokenizer)
        if stopped:
            rollout = paused_rows(rollout, decoder)
        return rollout


def paused_rows(rollout: Rollout, decoder: TandemDecoder) -> Rollout:
    """``rollout`` with its rows that have not ended (a ``StopRule`` ended the call) paused: their
    sequences saved in ``Rollout.paused``, and marked neither finished nor truncated."""
    running = (~decoder.state.finished).nonzero().flatten()
    if not running.numel():
        return rollout
    paused: list = [None] * decoder.batch_size
    for row, sequence in zip(running.tolist(), decoder.pause(running)):
        paused[row] = sequence
    return paused_result(rollout, paused)


def paused_result(rollout: Rollout, paused: list) -> Rollout:
    """``rollout`` with ``paused`` (per row: a ``PausedSequence``, or None for a row that ended)."""
    if all(p is None for p in paused):
        return rollout
    running = torch.tensor([p is not None for p in paused], device=rollout.finished.device)
    return dataclasses.replace(rollout, paused=paused, finished=rollout.finished & ~running,
                               truncated=rollout.truncated & ~running)


def cache_kwarg(model: nn.Module) -> str:
    """The forward() keyword of the KV cache: ``cache`` in newer transformers, else ``past_key_values``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


class _CachedForward:
    """One model's incremental forward over left-padded prompts with a dynamic cache."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache_kwarg = cache_kwarg(model)

    def prefill(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:  # -> [B, V]
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)  # hybrid (linear-attention) models need it
        self.mask = attention_mask
        self.position = attention_mask.cumsum(-1) - 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=self.position.clamp_min(0),
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kwarg: self.cache},
        )
        self.position = self.position[:, -1:]
        return out.logits[:, -1].float()

    def step(self, token: Tensor) -> Tensor:  # [B] -> [B, V]
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
        self.position = self.position + 1
        out = self.model(
            input_ids=token.unsqueeze(-1),
            attention_mask=self.mask,
            position_ids=self.position,
            use_cache=True,
            **{self.cache_kwarg: self.cache},
        )
        return out.logits[:, -1].float()
