"""FastEngine: static KV caches and one CUDA-graph decode step for both models.

Decoding is memory-bandwidth bound: each step must read both models' weights and their KV
caches once. Everything else is overhead to remove: per-token Python, dynamic cache growth,
kernel launch gaps, host syncs. So:

- Continuous batching: the rows of one ``generate`` are a queue (``continuous.ContinuousRun``).
  At most ``max_batch`` decode at once; every ``check_every`` steps the host reads the finished
  flags (end token, budget, span limit), collects finished sequences and refills their slots from
  the queue; once it is empty, the live rows are compacted into the next smaller captured batch
  size, so finished rows stop costing (``scheduler.SlotTable``). Everything on the device is per
  row (cache slot, position, valid mask, the decoder's step counter and RNG draws), so a sequence
  depends on its own seed only, never on its slot, its neighbours or when it was admitted.
  ``max_batch=None`` is the degenerate case: every row admitted at once, compaction only.
- Prefill runs the models' own Hugging Face decoder stack over the admitted prompts (left-padded
  among themselves); its keys/values (and Qwen3.5's linear-attention states) are copied into the
  freed rows of preallocated static caches. Refills are amortised (``scheduler.RefillTimer``):
  freed slots wait until their idle decode time reaches a prefill's, so several share one. The
  decode waits for a refill's prefill; ``overlap_prefill: on`` runs it on a second stream beside
  the next decode chunk instead (measured no faster: dev/log.md).
- KV layout (``kv_cache``): ``slots`` gives every decode row its own cache of prompt + cap
  positions, so memory is rows x (prompt + cap) whatever the sequences use, and compaction copies
  cache rows. ``paged`` keeps one pool of fixed-size pages per layer and model and one block
  table row per decode row, shared by both models (``paging.py``): a sequence holds the pages of
  the positions it has written, admission waits for free pages, a sequence that needs a page
  when none is free preempts the newest one, and compaction moves table rows, not K/V. A
  preempted sequence keeps its tokens and decoder state; readmitted, it prefills its prompt and
  those tokens in one pass (vLLM's recompute preemption) and goes on where it stopped, its RNG
  draws keyed by seed and position as before.
  Qwen3.5's linear-attention states stay per row (they are O(1) per sequence).
- One decode step = senior forward + junior forward + sampling + handoff draw + author record +
  stop flags (the shared ``TandemDecoder``), written against static buffers and captured once as
  a CUDA graph per (ladder batch size, attention length bucket, sampling/handoff settings), all
  in one memory pool, then replayed.
- The decode forward is a small reimplementation of the Llama-family block (Llama, Mistral,
  Qwen2, Qwen3) that reads the parameters of the model it is given. In training that is the
  senior's rollout copy (bf16, LoRA merged; ``tandem_lit.rollout.weights``), refreshed through
  ``load_weights`` after optimiser updates; with ``rollout_dtype: live`` it reads the trained
  parameters themselves, LoRA adapters included.
- On CUDA the junior's forward runs on a second stream, concurrently with the senior's (both
  read only the token just appended; they meet again at the next step's sampling), so one
  model's small latency-bound kernels fill the other's gaps. The fork/join is captured into
  the graph as two parallel branches.
- Solo policies (p=0 or p=1) skip the other model entirely, so tandem-vs-solo timings compare
  like with like. On CPU the same step runs eagerly (tests, the offline demo).
"""

from __future__ import annotations

import math
import time
from dataclasses import astuple
from typing import Literal

import torch
from torch import Tensor, nn

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.decoder import TandemDecoder, package_rollout
from tandem_lit.rollout.engine import EngineTiming, KVBudget, RolloutEngine, eval_mode, model_prompts, paused_result
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.rollout.record import PromptBatch, Rollout, StopRule
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static.blocks import FP8_CACHE
from tandem_lit.rollout.static.continuous import ContinuousRun, RunSettings, paged_table
from tandem_lit.rollout.static.hybrid import HYBRID_MODEL_TYPES, HybridDecoderModel
from tandem_lit.rollout.static.plain import StaticDecoderModel
from tandem_lit.rollout.static.scheduler import SlotTable
from tandem_lit.rollout.weights import check_rollout_dtype


def buf_slots(engine: FastEngine) -> bool:
    """True when the engine keeps slot caches (every row its own prompt + cap positions)."""
    return engine.kv_cache != "paged"


def decoder_model(model: nn.Module):
    """The decode step for ``model``: ``HybridDecoderModel`` for Qwen3.5's hybrid attention,
    else ``StaticDecoderModel`` (Llama family). Raises ConfigError naming what is unsupported."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "model_type", None) in HYBRID_MODEL_TYPES:
        return HybridDecoderModel(model)
    return StaticDecoderModel(model)


def check_architecture(config) -> None:
    """Raise ConfigError naming what FastEngine cannot decode in this model config."""
    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
        HybridDecoderModel.check_architecture(config)
    else:
        StaticDecoderModel.check_architecture(config)


def check_kv_cache(kv_cache: str, page_size: int, tokens: int | None, gib: float | str | None) -> None:
    """Raise ConfigError (one line) for FastEngine's KV-layout settings that cannot work."""
    if gib == "auto":  # sized when fit starts on a GPU (``TandemModule.size_kv_pool``)
        if kv_cache != "paged" or tokens is not None:
            raise ConfigError("kv_cache_gib: auto sizes a paged pool from the GPU and the memory plan: set kv_cache: paged "
                              "and leave kv_cache_tokens out")
        return
    if isinstance(gib, str):
        raise ConfigError(f"kv_cache_gib must be a size in GiB or 'auto', got {gib!r}")
    if kv_cache not in ("slots", "paged"):
        raise ConfigError(f"kv_cache must be 'slots' or 'paged', got {kv_cache!r}")
    if page_size < 1:
        raise ConfigError(f"kv_page_size must be >= 1, got {page_size}")
    if tokens is not None and gib is not None:
        raise ConfigError("set kv_cache_tokens or kv_cache_gib, not both")
    if (tokens is not None and tokens < 1) or (gib is not None and not gib > 0):
        raise ConfigError(f"the paged KV pool needs a positive size, got kv_cache_tokens={tokens}, kv_cache_gib={gib}")
    if kv_cache == "slots" and (tokens is not None or gib is not None):
        raise ConfigError("kv_cache_tokens / kv_cache_gib size the paged pool: set kv_cache: paged")


class _Batch:
    """Buffers shared by both models for one batch capacity: per-row cache slots, positions,
    masks, logits, and with a paged pool the block table. Everything is per row (dim 0 = decode
    slot), so a row can be refilled with a new sequence or moved by compaction without touching
    its neighbours."""

    def __init__(self, capacity: int, length: int, vocab: dict[str, int], device, pages: int = 0, page_size: int = 1):
        self.capacity, self.length = capacity, length
        self.pages = pages  # pool pages (0: slots layout)
        # logical page -> pool page of each row's sequence; 0 (the scratch page) where it holds none.
        # Written by the host between chunks (``PagedSlotTable.page_rows``), read by every step.
        self.table = (torch.zeros(capacity, -(-length // page_size), dtype=torch.int32, device=device)
                      if pages else None)
        # each row's cache slot of its newest token: rows admitted at different steps, or with
        # prompts of different widths, sit at different depths of their caches
        self.slot = torch.zeros(capacity, dtype=torch.long, device=device)
        # per model: each may have its own prompt (own system prompt or template), so the same
        # response token sits at its own rotary position and the padding differs
        self.position = {name: torch.zeros(capacity, dtype=torch.long, device=device) for name in vocab}
        self.valid = {name: torch.zeros(capacity, length, dtype=torch.bool, device=device) for name in vocab}
        # float32: sampling and log-probs read them several times; convert once per step
        self.logits = {name: torch.zeros(capacity, vocab[name], dtype=torch.float32, device=device) for name in vocab}
        # the cache positions each step's attention reads, summed over its rows and steps (each active
        # model reads them all): what the decode's bytes are made of (``ContinuousRun.timing``)
        self.attended = torch.zeros((), dtype=torch.long, device=device)

    def per_row(self) -> list[Tensor]:
        return [self.slot, *self.position.values(), *self.valid.values(), *self.logits.values()]


class FastEngine(RolloutEngine):
    """Static-cache tandem engine; one CUDA graph per decode step on GPU, eager on CPU.

    ``setup``'s ``max_batch`` (in training ``rollout.batch_size``) is how many sequences decode at
    once (None: every row of a ``generate`` call). The rows of a call are a queue: when sequences
    finish, their slots are refilled from it (one batched prefill of both models); once it is
    empty, the live rows are compacted into the next smaller captured batch size. Slot KV caches
    are sized for ``max_batch`` rows.

    Args:
        cuda_graphs: Capture and replay the decode step on CUDA devices.
        kernels: ``triton`` fused decode kernels (CUDA only), ``torch`` plain tensor ops (any
            device; bit-comparable with transformers' eager code), or ``auto``: triton on CUDA,
            torch elsewhere.
        kv_block: Attention length bucket of the torch path (tokens): each graph attends to a
            multiple of this, so short sequences do not read the whole cache.
        check_every: Look at the finished flags every this many steps (one host sync each).
        fuse_weights: With the Triton kernels, run q/k/v and gate/up as one GEMM each. The rollout
            copy and the frozen junior store those weights fused (no extra memory); trained
            weights decoded in place get a fused copy re-synced at every ``generate``.
            Projections with LoRA adapters (``rollout_dtype: live``) are never fused.
        overlap_junior: On CUDA, in tandem, run the junior's decode forward on a second stream
            concurrently with the senior's (same results; off: one stream, one after the other).
        rollout_dtype: Dtype of the senior's rollout copy (see ``RolloutEngine``; ``auto``: bf16 on
            a GPU, so a float32 or LoRA-wrapped senior decodes at bf16 speed).
        refill: When freed slots take queued sequences: ``amortized`` (default) once the decode
            time the empty slots have cost reaches one prefill's, so several share a prefill;
            ``eager`` as soon as they free up (``scheduler.RefillTimer``). Speed only: a sequence
            never depends on when it is admitted.
        kv_cache: ``slots`` (default): one KV cache row of prompt + ``max_new_tokens`` positions per
            decode row. ``paged``: a pool of pages per layer and model, one block table shared by
            both models; sequences hold the pages they use, admission waits for free pages, and a
            sequence that needs a page when none is free preempts the newest (resumed later: its
            prompt and the tokens it wrote prefilled at once), so concurrency is bounded by the
            tokens in use.
        kv_page_size: Token positions per page of the paged pool.
        kv_cache_tokens: Token positions the paged pool holds (each: both models' K/V). Default
            (neither this nor ``kv_cache_gib``): what the slots layout would hold, ``max_batch`` x
            (widest prompt + ``max_new_tokens``), so nothing is ever preempted.
        kv_cache_gib: The paged pool's size in GiB instead (both models' K/V; not Qwen3.5's per-row
            linear-attention states). ``auto``: when fit starts on a GPU, the pool and
            ``prefill_tokens`` are sized from the card's memory and the run's memory plan
            (``training.memory.size_rollout_memory``); elsewhere as if unsized.
        overlap_prefill: ``on``: a refill's prefill runs beside the next decode chunk (on CUDA its
            forwards on a second stream), its sequences decoding from the chunk after; ``off``
            (default): the decode waits for every refill. Speed only, as ``refill``. Off by
            default because it measured no gain: refills are amortised, so the waited-for
            prefills are a small part of a rollout, and a prefill beside a decode chunk slows
            that chunk about as much as it saves (dev/log.md).
            On the CPU nothing overlaps: ``on`` only defers admissions, as the CPU tests check.
        prefill_tokens: Padded positions one prefill call holds at most (rows x the longest):
            an admission of more runs as several prefills (resumed sequences prefill their
            responses too, thousands of positions each).
        kv_cache_dtype: ``auto`` (default): keys and values cached in the decoded model's dtype.
            ``fp8``: in 8 bits (float8_e4m3fn, scale 1, entries clamped to +-448), as vLLM's
            ``kv_cache_dtype: fp8``: half the memory per token position, so the pool holds twice
            the positions, and fewer bytes for a decode step to read (the Triton kernel widens them
            to float16 for a 16-bit model: widened to bf16 it was no faster than a bf16 cache,
            docs/performance.md). The rollout's log-probs then differ more
            from the trainer's (which never rounds its keys): training requires the objective's
            ``tis_cap`` (``training.preflight``); watch ``mismatch_kl`` and ``rollout_logp_gap_*``.
            Plain attention models only (Llama, Mistral, Qwen2, Qwen3), not Qwen3.5's hybrid layers.
        attention_split: ``None`` (default): the Triton decode attention reads each row's cache
            with one program per KV head, so the longest row's context is read by one program
            alone; a number (a multiple of 128): slots in chunks of that many, each chunk its own
            program, merged by a second kernel (flash-decoding). Speed only (the sums are
            reordered, so tokens may differ in the last bit of a log-prob). Off by default: on an
            H100 the kernel alone gained at long-tailed lengths, but a training step's decode step
            did not shorten (docs/performance.md, "The decode-attention kernel alone" and the
            partial-rollouts table). Plain attention models only.
        attention_order: ``longest_first`` (default): the Triton decode attention starts its
            programs row by row, longest row first, so the longest rows are not among those that
            wait for a second wave (at 128 rows not every program is resident at once); ``rows``:
            row-major by KV head, as before 2026-12-08, to compare. Speed only: the same tokens.
    """

    queues_rows = True
    pauses = True

    def __init__(
        self,
        cuda_graphs: bool = True,
        kernels: Literal["auto", "torch", "triton"] = "auto",
        kv_block: int = 128,
        check_every: int = 16,
        fuse_weights: bool = True,
        overlap_junior: bool = True,
        rollout_dtype: str = "auto",
        kv_cache: Literal["slots", "paged"] = "slots",
        kv_page_size: int = 64,
        kv_cache_tokens: int | None = None,
        kv_cache_gib: float | Literal["auto"] | None = None,
        refill: Literal["amortized", "eager"] = "amortized",
        prefill_tokens: int = 16384,
        overlap_prefill: Literal["on", "off"] = "off",
        kv_cache_dtype: Literal["auto", "fp8"] = "auto",
        attention_split: int | None = None,
        attention_order: Literal["longest_first", "rows"] = "longest_first",
    ):
        if refill not in ("amortized", "eager"):
            raise ConfigError(f"refill must be 'amortized' or 'eager', got {refill!r}")
        self.refill = refill
        if kv_block < 1 or check_every < 1 or prefill_tokens < 1:
            raise ConfigError("kv_block, check_every and prefill_tokens must be >= 1")
        self.prefill_tokens = prefill_tokens
        if overlap_prefill not in ("on", "off"):
            raise ConfigError(f"overlap_prefill must be 'on' or 'off', got {overlap_prefill!r}")
        self.overlap_prefill = overlap_prefill
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        if attention_split is not None and (attention_split < 128 or attention_split % 128):
            raise ConfigError(f"attention_split must be a multiple of 128 (slots per program) or null, got {attention_split!r}")
        self.attention_split = attention_split
        if attention_order not in ("longest_first", "rows"):
            raise ConfigError(f"attention_order must be 'longest_first' or 'rows', got {attention_order!r}")
        self.attention_order = attention_order
        check_kv_cache(kv_cache, kv_page_size, kv_cache_tokens, kv_cache_gib)
        self.kv_cache, self.kv_page_size = kv_cache, kv_page_size
        self.kv_cache_tokens, self.kv_cache_gib = kv_cache_tokens, kv_cache_gib
        if kernels not in ("auto", "torch", "triton"):
            raise ConfigError(f"kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
        self.cuda_graphs = cuda_graphs
        self.kernels = kernels
        self.fuse_weights = fuse_weights
        self.kv_block = kv_block
        self.check_every = check_every
        self.overlap_junior = overlap_junior
        self.rollout_dtype = check_rollout_dtype(rollout_dtype)

    def setup(self, senior: nn.Module, junior: nn.Module | None, tokenizer, junior_tokenizer=None,
              max_batch: int | None = None) -> None:
        super().setup(senior, junior, tokenizer, junior_tokenizer, max_batch)
        self.models = {"senior": decoder_model(self.senior)}
        if junior is not None:
            self.models["junior"] = decoder_model(junior)
            if self.models["junior"].device != self.models["senior"].device:
                raise ConfigError("FastEngine needs the senior and junior on the same device")
        if self.kv_cache_dtype == "fp8" and (hybrid := self._hybrid_model()):
            raise ConfigError(f"FastEngine(kv_cache_dtype='fp8') caches plain attention layers only; the {hybrid}: "
                              "use kv_cache_dtype: auto")
        if self.attention_split is not None and (hybrid := self._hybrid_model()):
            raise ConfigError(f"FastEngine(attention_split=...) splits plain attention layers only; the {hybrid}: "
                              "use attention_split: null")
        self._set_decode_settings()
        self._batch: _Batch | None = None
        self._decoders: dict[tuple, TandemDecoder] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._weights_at_capture: dict[str, int] = {}
        self._side_stream: torch.cuda.Stream | None = None  # created on the first overlapped step
        self._prefill_stream: torch.cuda.Stream | None = None  # created on the first overlapped refill
        self._last_run: ContinuousRun | None = None
        device = self.models["senior"].device
        if self.kernels == "triton" and device.type != "cuda":
            raise ConfigError("FastEngine(kernels='triton') needs a CUDA device; use kernels: torch or auto")
        self.triton = device.type == "cuda" and self.kernels != "torch"
        if self.triton and self.fuse_weights:
            # the rollout copy and the frozen junior can lend their storage to the fused
            # weights; trained weights decoded in place keep their own and are re-synced
            for name, model in self.models.items():
                model.fuse_projections(share=name == "junior" or self.decodes_copy)

    def kv_pool_size(self) -> tuple[int | None, float | None]:
        if self.kv_cache == "paged":  # the pool, whatever the batch (auto: not sized yet)
            return self.kv_cache_tokens, None if self.kv_cache_gib == "auto" else self.kv_cache_gib
        return None, None

    def plan_kv_cache(self, budget: KVBudget) -> str | None:
        """Size a paged pool against the device, and say so: a pool left unsized defaults to the
        slot caches' size; when that does not fit, it gets the positions that do (admission then
        waits for free pages instead of the rollout running out of memory). Slot caches, or no
        device to fit: nothing to plan."""
        if self.kv_cache != "paged" or budget.fitting_tokens is None:
            return None
        if self.kv_cache_gib == "auto":
            self.kv_cache_tokens, self.prefill_tokens = budget.size_for_card(self.prefill_tokens)
            return (f"kv_cache_gib: auto sized the KV pool to {self.kv_cache_tokens:,} token positions and "
                    f"prefill_tokens to {self.prefill_tokens:,}")
        tokens, fit, planned = budget.planned_tokens, budget.fitting_tokens, budget.planned_bytes
        sized_by = "engine.kv_cache_tokens / kv_cache_gib"
        if self.kv_cache_tokens is None and self.kv_cache_gib is None:
            sized_by = "rollout sequences x (prompt + max_new_tokens)"
            if 0 < fit < tokens:
                self.kv_cache_tokens = tokens = fit
                planned = fit * budget.bytes_per_token
                sized_by = "what fits the GPU"
        return (f"paged KV pool: {tokens:,} token positions, {planned / 1024**3:.1f} GiB ({sized_by}); "
                f"{fit:,} fit beside the rest of the rollout phase")

    def prefill_size(self) -> int | None:
        return self.prefill_tokens

    def why_no_kept_caches(self) -> str | None:
        if self.kv_cache != "paged":
            return "FastEngine keeps paused sequences' caches in a paged pool only: set the engine's kv_cache: paged"
        if hybrid := self._hybrid_model():
            return f"FastEngine keeps paused caches of plain attention models only; the {hybrid}: set rollout.partial.keep_caches: none"
        return None

    def _hybrid_model(self) -> str | None:
        """'<name> is <model_type> (hybrid attention)' for the first model with Qwen3.5's hybrid
        layers, whose caches the 8-bit and kept-cache paths do not handle; None: all are plain."""
        for name, model in self.models.items():
            if not isinstance(model, StaticDecoderModel):
                return f"{name} is {model.config.model_type} (hybrid attention)"
        return None

    def kv_cache_bytes(self) -> int | None:
        return 1 if self.kv_cache_dtype == "fp8" else None

    def release(self) -> None:
        """Free the KV caches, buffers and captured graphs (re-allocated and re-captured by the
        next ``generate``), so that a training update can use their memory."""
        self._decoders.clear()
        self._drop_graphs()
        self._batch = None
        for model in self.models.values():
            model.free()
        if self.models["senior"].device.type == "cuda":
            torch.cuda.empty_cache()  # graph pools hold their memory until then

    # ------------------------------------------------------------------------------ buffers

    def _ensure_capacity(self, batch: int, length: int) -> _Batch:
        current = self._batch
        if current is not None and current.capacity >= batch and current.length >= length:
            return current
        capacity = max(batch, current.capacity if current else 0)
        length = max(length, current.length if current else 0)
        length = math.ceil(length / self.kv_block) * self.kv_block
        self._decoders.clear()  # decoders and graphs hold views of the old buffers
        self._drop_graphs()
        self._batch = None
        self._set_decode_settings()  # (again: a benchmark may switch kv_cache_dtype between calls)
        pages = self._pool_pages(capacity, length) if self.kv_cache == "paged" else 0
        for model in self.models.values():
            model.allocate(capacity, length, pages, self.kv_page_size)
        any_model = self.models["senior"]
        vocab = {name: m.lm_head.weight.shape[0] for name, m in self.models.items()}
        self._batch = _Batch(capacity, length, vocab, any_model.device, pages, self.kv_page_size)
        return self._batch

    def _set_decode_settings(self) -> None:  # (and the attention's split and order: read when a step is captured)
        for model in self.models.values():
            if isinstance(model, StaticDecoderModel):
                model.cache_dtype = FP8_CACHE if self.kv_cache_dtype == "fp8" else model.dtype
                model.split_positions = self.attention_split
                model.programs_longest_first = self.attention_order == "longest_first"

    def _pool_pages(self, capacity: int, length: int) -> int:
        """Pages of the paged pool, the scratch page included (see ``kv_cache_tokens``)."""
        page = self.kv_page_size
        if self.kv_cache_gib is not None and self.kv_cache_gib != "auto":
            per_page = page * sum(m.kv_bytes_per_token() for m in self.models.values())
            return max(int(self.kv_cache_gib * 1024**3 // per_page), 2)
        if self.kv_cache_tokens is not None:
            return -(-self.kv_cache_tokens // page) + 1
        return capacity * -(-length // page) + 1

    def _decoder(self, policy: HandoffPolicy, sampling: SamplingConfig, capacity: int) -> tuple[tuple, TandemDecoder]:
        key = (repr(policy), astuple(sampling), capacity)
        if key not in self._decoders:
            device = self.models["senior"].device
            self._decoders[key] = TandemDecoder(
                policy, self.token_classes(device), sampling, capacity, self.eos_token_ids, self.pad_token_id,
                fused_sampling=self.triton,
            )
        return key, self._decoders[key]

    # ------------------------------------------------------------------------------- decode

    def _step(self, decoder: TandemDecoder, kv_len: int) -> None:
        """One decode step of rows [0, decoder.batch_size) on the static buffers (the body a CUDA
        graph captures, once per ladder size)."""
        buf, batch = self._batch, decoder.batch_size
        senior = buf.logits["senior"][:batch] if decoder.needs_senior else None
        junior = buf.logits["junior"][:batch] if decoder.needs_junior else None
        token = decoder.step(senior, junior)
        slot = buf.slot[:batch]
        # rows that stopped (or hold no sequence) keep stepping until the host retires or refills
        # them, at a slot that stays put: the attention kernel reads a row's slots below its own,
        # so an emptied row (slot 0) reads nothing, and a row that just ended rewrites its last slot
        slot.add_((~decoder.state.finished).long()).clamp_(max=buf.length - 1)
        buf.attended.add_(slot.sum() + batch)  # each row reads its slots [0, slot]
        for name, logits in (("senior", senior), ("junior", junior)):
            if logits is not None:
                buf.position[name][:batch].add_(1).clamp_(max=buf.length - 1)
                buf.valid[name][:batch].scatter_(1, slot.unsqueeze(1), True)

        def forward(name: str, out: Tensor) -> None:
            position = buf.position[name][:batch]
            out.copy_(self.models[name].decode(token, position, slot, buf.valid[name], kv_len, self.triton, buf.table))

        if senior is not None and junior is not None and self._overlap():
            # The two forwards are independent until the next step's sampling, and each alone
            # leaves the GPU partly idle (latency-bound norms/attention, GEMM tails): run the
            # junior on a side stream. Fork: the side stream waits for this step's token; join:
            # the main stream waits for the junior's logits. Valid inside CUDA graph capture.
            main, side = torch.cuda.current_stream(), self._side()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                forward("junior", junior)
            forward("senior", senior)
            main.wait_stream(side)
            token.record_stream(side)  # allocated on main, read on side: no early reuse
        else:
            if senior is not None:
                forward("senior", senior)
            if junior is not None:
                forward("junior", junior)

    def _overlap(self) -> bool:
        return self.overlap_junior and self.models["senior"].device.type == "cuda"

    def _side(self) -> torch.cuda.Stream:
        # one stream for the engine's life: warm-up and capture must use the same one, so the
        # cuBLAS workspace of that stream is allocated eagerly, not inside the graph's pool
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.models["senior"].device)
        return self._side_stream

    def _graph(self, key: tuple, decoder: TandemDecoder, kv_len: int) -> torch.cuda.CUDAGraph:
        """The captured step for this batch size (one per ladder size, all in one memory pool)."""
        graph_key = (key, decoder.batch_size, kv_len, self._overlap())
        if graph_key not in self._graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # warm up on a side stream (lazy cuBLAS/allocator init) with in-range counters;
            # generate() admits every sequence afresh after capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._zero_counters()
                    self._step(decoder, kv_len)
            torch.cuda.current_stream().wait_stream(stream)
            self._zero_counters()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(decoder, kv_len)
            self._graphs[graph_key] = graph
        return self._graphs[graph_key]

    def _zero_counters(self) -> None:
        buf = self._batch
        for counter in (buf.slot, *buf.position.values()):
            counter.zero_()

    def _check_weights_in_place(self) -> None:
        """Graphs read parameters by address: if a model was moved or its storage replaced,
        the captured graphs are stale."""
        pointers = {name: m.first_weight_ptr() for name, m in self.models.items()}
        if self._weights_at_capture and pointers != self._weights_at_capture:
            self._drop_graphs()
        self._weights_at_capture = pointers

    def _drop_graphs(self) -> None:
        # a memory pool whose graphs are all gone cannot host new captures: start a new one
        self._graphs.clear()
        self._pool = None

    def generate(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig,
                 stop: StopRule | None = None) -> Rollout:
        """Decode every row of ``prompts``, at most ``max_batch`` at a time (a queue, see the class).
        ``stop`` and ``prompts.resume``: see ``RolloutEngine.pauses`` (a resumed sequence waits in
        the queue as a preempted one, and prefills its prompt and tokens when admitted)."""
        self.check_models(policy)
        if stop is not None and stop.keep_caches and (reason := self.why_no_kept_caches()):
            raise ConfigError(reason)
        device = self.models["senior"].device
        prompts = prompts.to(device)
        budgets = prompts.budgets(sampling.max_new_tokens)
        rows = prompts.batch_size
        width = model_prompts(prompts)["senior"][0].shape[1]  # the widest prompt of any group
        capacity = min(self.max_batch or rows, rows)
        use_graphs = self.cuda_graphs and device.type == "cuda"
        started = time.perf_counter()
        written = [p.written if p is not None and p.state is not None else 0 for p in prompts.resume or [None] * rows]
        # slot caches: a resumed group's prompts sit left-padded to its longest response, then decode on
        buf = self._ensure_capacity(capacity, width + sampling.max_new_tokens + (max(written) if buf_slots(self) else 0))
        key, decoder = self._decoder(policy, sampling, capacity)
        if buf.table is not None:
            table = paged_table(prompts, budgets, capacity, buf.table, buf.pages, self.kv_page_size)
            for sequence, tokens in enumerate(written):
                if tokens:
                    table.resume_later(sequence, tokens)
        else:
            table = SlotTable(list(range(rows)), capacity, (budgets.cpu() - torch.tensor(written)).tolist())
        settings = RunSettings(self.check_every, self.refill, self.overlap_prefill, self.prefill_tokens,
                               self.kv_page_size)
        run = ContinuousRun(buf, self.models, decoder, table, settings, self._prefill_side)
        run.width = width
        active = [name for name, needed in (("senior", decoder.needs_senior), ("junior", decoder.needs_junior)) if needed]

        def step(view: TandemDecoder, kv_len: int) -> None:
            if use_graphs:
                self._graph(key, view, kv_len).replay()
            else:
                self._step(view, kv_len)

        # static caches hold the weights' dtype: decode in it, also inside a bf16-mixed training step
        no_autocast = torch.autocast(device_type=device.type, enabled=False)
        with eval_mode(*(self.models[name].model for name in active)), no_autocast:
            for name in active:
                self.models[name].sync()
            if use_graphs:  # captured before any sequence is admitted: warm-up steps scribble on the buffers
                self._check_weights_in_place()
                for size in table.ladder:
                    for kv_len in sorted({self._kv_len(n) for n in range(1, buf.length + 1)}):
                        self._graph(key, decoder.narrow(size), kv_len)
            run.setup_s = time.perf_counter() - started
            results = run.decode(prompts, budgets, active, step, self._kv_len, stop)
        self._last_run = run
        rollout = package_rollout(prompts, results, self.tokenizer, decoder.needs_senior, decoder.token_sets)
        return paused_result(rollout, run.paused_sequences(rows)) if run.stopped else rollout

    def _prefill_side(self) -> torch.cuda.Stream:
        if self._prefill_stream is None:
            self._prefill_stream = torch.cuda.Stream(device=self.models["senior"].device)
        return self._prefill_stream

    def last_timing(self) -> EngineTiming:
        """Where the last ``generate`` spent its time: setup seconds (cache allocation and graph
        capture: zero when both are reused), prefill seconds (every refill included), decode
        seconds and steps (prefills run beside decode chunks, ``prefill_beside_s`` of
        ``prefill_s``, are decode time too); ``busy_slot_fraction``: tokens written over the rows
        the steps paid for (live row-steps / decoded row-steps); refills (admissions after
        decoding started) and compactions; ``prompt_width``: the widest padded prompt. With
        ``kv_cache: paged`` also ``preemptions``, ``resumed_tokens`` (response tokens preempted
        sequences prefilled again to go on), ``kv_pool_tokens`` (positions the pool holds) and
        ``kv_pool_peak_fraction`` (the most of it held at once)."""
        if self._last_run is None:
            raise RuntimeError("last_timing() reports on a generate() call; none has run yet")
        return self._last_run.timing()

    def _kv_len(self, needed: int) -> int:
        if self.triton:  # the attention kernel reads its bound on the device: one graph for all steps
            return self._batch.length
        return min(math.ceil(needed / self.kv_block) * self.kv_block, self._batch.length)
