"""FastEngine: static KV caches and one CUDA-graph decode step for both models.

Decoding is memory-bandwidth bound: each step must read both models' weights and their KV
caches once. Everything else is overhead to remove: per-token Python, dynamic cache growth,
kernel launch gaps, host syncs. So:

- Continuous batching: the rows of one ``generate`` are a queue. At most ``max_batch`` decode at
  once; every ``check_every`` steps the host reads the finished flags (end token, budget, span
  limit), collects finished sequences and refills their slots from the queue; once it is empty,
  the live rows are compacted into the next smaller captured batch size, so finished rows stop
  costing (``scheduler.SlotTable``). Everything on the device is per row (cache slot, position,
  valid mask, the decoder's step counter and RNG draws), so a sequence depends on its own seed
  only, never on its slot, its neighbours or when it was admitted. ``max_batch=None`` is the
  degenerate case: every row admitted at once, compaction only.
- Prefill runs the models' own Hugging Face decoder stack over the admitted prompts (left-padded
  among themselves); its keys/values (and Qwen3.5's linear-attention states) are copied into the
  freed rows of preallocated static caches. A refill's prefill (on CUDA) runs on its own stream
  beside the next decode chunk, which the live rows decode meanwhile: at a few prompts a prefill
  is thousands of small kernel launches (Qwen3.5's Hugging Face stack: ~0.1 s for the 9B), so
  the host issues them while the GPU decodes instead of the GPU waiting for the host. Its copy
  into the freed rows waits for that chunk, and the admitted rows decode from the chunk after.
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

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.decoder import TandemDecoder, package_rollout
from tandem_lit.rollout.engine import RolloutEngine, eval_mode, model_prompts
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.rollout.record import PromptBatch, Rollout
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static.hybrid import HYBRID_MODEL_TYPES, HybridDecoderModel
from tandem_lit.rollout.static.paging import BlockManager, prompt_placement, write_table_rows
from tandem_lit.rollout.static.plain import StaticDecoderModel
from tandem_lit.rollout.static.scheduler import PagedSlotTable, RefillTimer, SlotTable
from tandem_lit.rollout.weights import check_rollout_dtype


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


def check_kv_cache(kv_cache: str, page_size: int, tokens: int | None, gib: float | None) -> None:
    """Raise ConfigError (one line) for FastEngine's KV-layout settings that cannot work."""
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

    def per_row(self) -> list[Tensor]:
        return [self.slot, *self.position.values(), *self.valid.values(), *self.logits.values()]


class _PhaseClock:
    """Marks points of one ``generate`` without a host sync (CUDA events; the host clock on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        self.marks.append(_mark(self.cuda))

    def seconds(self) -> list[float]:
        """Time between consecutive marks (waits for the last one on CUDA)."""
        if self.cuda:
            self.marks[-1].synchronize()
        return [_seconds(a, b) for a, b in zip(self.marks, self.marks[1:])]


class FastEngine(RolloutEngine):
    """Static-cache tandem engine; one CUDA graph per decode step on GPU, eager on CPU.

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
        max_batch: Sequences decoded at once (None: every row of a ``generate`` call). The rows of
            a call are a queue: when sequences finish, their slots are refilled from it (one
            batched prefill of both models); once it is empty, the live rows are compacted into
            the next smaller captured batch size. Slot KV caches are sized for ``max_batch`` rows.
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
            linear-attention states).
        overlap_prefill: ``on``: a refill's prefill runs beside the next decode chunk (on CUDA its
            forwards on a second stream), its sequences decoding from the chunk after; ``off``
            (default): the decode waits for every refill. Speed only, as ``refill``. Off by
            default because it measured no gain: refills are amortised, so the waited-for
            prefills are a few percent of a rollout, and a prefill beside a decode chunk slows
            that chunk about as much as it saves (docs/benchmarks.md, "Prefill beside decode").
            On the CPU nothing overlaps: ``on`` only defers admissions, as the CPU tests check.
        prefill_tokens: Padded positions one prefill call holds at most (rows x the longest):
            an admission of more runs as several prefills (resumed sequences prefill their
            responses too, thousands of positions each).
    """

    queues_rows = True

    def __init__(
        self,
        cuda_graphs: bool = True,
        kernels: Literal["auto", "torch", "triton"] = "auto",
        kv_block: int = 128,
        check_every: int = 16,
        fuse_weights: bool = True,
        overlap_junior: bool = True,
        rollout_dtype: str = "auto",
        max_batch: int | None = None,
        kv_cache: Literal["slots", "paged"] = "slots",
        kv_page_size: int = 64,
        kv_cache_tokens: int | None = None,
        kv_cache_gib: float | None = None,
        refill: Literal["amortized", "eager"] = "amortized",
        prefill_tokens: int = 16384,
        overlap_prefill: Literal["on", "off"] = "off",
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
        check_kv_cache(kv_cache, kv_page_size, kv_cache_tokens, kv_cache_gib)
        self.kv_cache, self.kv_page_size = kv_cache, kv_page_size
        self.kv_cache_tokens, self.kv_cache_gib = kv_cache_tokens, kv_cache_gib
        if max_batch is not None and max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1 (or None: all rows at once), got {max_batch}")
        self.max_batch = max_batch
        if kernels not in ("auto", "torch", "triton"):
            raise ConfigError(f"kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
        self.cuda_graphs = cuda_graphs
        self.kernels = kernels
        self.fuse_weights = fuse_weights
        self.kv_block = kv_block
        self.check_every = check_every
        self.overlap_junior = overlap_junior
        self.rollout_dtype = check_rollout_dtype(rollout_dtype)

    def setup(self, senior: nn.Module, junior: nn.Module | None, tokenizer, junior_tokenizer=None) -> None:
        super().setup(senior, junior, tokenizer, junior_tokenizer)
        self.models = {"senior": decoder_model(self.senior)}
        if junior is not None:
            self.models["junior"] = decoder_model(junior)
            if self.models["junior"].device != self.models["senior"].device:
                raise ConfigError("FastEngine needs the senior and junior on the same device")
        self._batch: _Batch | None = None
        self._decoders: dict[tuple, TandemDecoder] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._weights_at_capture: dict[str, int] = {}
        self._side_stream: torch.cuda.Stream | None = None  # created on the first overlapped step
        self._prefill_stream: torch.cuda.Stream | None = None  # created on the first overlapped refill
        self._last_run: _Run | None = None
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
        if self.kv_cache == "paged":  # the pool, whatever the batch
            return self.kv_cache_tokens, self.kv_cache_gib
        return None, None

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
        pages = self._pool_pages(capacity, length) if self.kv_cache == "paged" else 0
        for model in self.models.values():
            model.allocate(capacity, length, pages, self.kv_page_size)
        any_model = self.models["senior"]
        vocab = {name: m.lm_head.weight.shape[0] for name, m in self.models.items()}
        self._batch = _Batch(capacity, length, vocab, any_model.device, pages, self.kv_page_size)
        return self._batch

    def _pool_pages(self, capacity: int, length: int) -> int:
        """Pages of the paged pool, the scratch page included (see ``kv_cache_tokens``)."""
        page = self.kv_page_size
        if self.kv_cache_gib is not None:
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

    def generate(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig) -> Rollout:
        """Decode every row of ``prompts``, at most ``max_batch`` at a time (a queue, see the class)."""
        self.check_models(policy)
        device = self.models["senior"].device
        prompts = prompts.to(device)
        budgets = prompts.budgets(sampling.max_new_tokens)
        rows = prompts.batch_size
        width = model_prompts(prompts)["senior"][0].shape[1]  # the widest prompt of any group
        capacity = min(self.max_batch or rows, rows)
        use_graphs = self.cuda_graphs and device.type == "cuda"
        started = time.perf_counter()
        buf = self._ensure_capacity(capacity, width + sampling.max_new_tokens)
        key, decoder = self._decoder(policy, sampling, capacity)
        if buf.table is not None:
            table = self._paged_table(prompts, budgets, capacity, buf)
        else:
            table = SlotTable(list(range(rows)), capacity, budgets.tolist())
        run = _Run(decoder, table, _PhaseClock(device), RefillTimer(self.refill))
        run.width = width
        active = [name for name, needed in (("senior", decoder.needs_senior), ("junior", decoder.needs_junior)) if needed]
        # static caches hold the weights' dtype: decode in it, also inside a bf16-mixed training step
        no_autocast = torch.autocast(device_type=device.type, enabled=False)
        with eval_mode(*(self.models[name].model for name in active)), no_autocast:
            for name in active:
                self.models[name].sync()
            if use_graphs:  # captured before any sequence is admitted: warm-up steps scribble on the buffers
                self._check_weights_in_place()
                for size in run.table.ladder:
                    for kv_len in sorted({self._kv_len(n) for n in range(1, buf.length + 1)}):
                        self._graph(key, decoder.narrow(size), kv_len)
            run.setup_s = time.perf_counter() - started
            decoder.vacate()
            results = {name: torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=device)
                       for name, x in decoder.outputs().items()}
            run.clock.mark()
            self._admit(run, prompts, budgets, active)
            run.timer.free = run.table.batch - len(run.table.live)  # a paged pool may admit fewer
            synced = time.perf_counter()
            refill_beside = False  # a refill decided after the last chunk, prefilled beside this one
            overlaps_prefill = self.overlap_prefill == "on"
            while True:
                view = decoder.narrow(run.table.batch)
                steps = min(self.check_every, run.table.steps_left())
                if buf.table is not None:  # pages for this chunk's positions (may preempt)
                    self._reserve(run, steps)
                    steps = min(steps, run.table.steps_left())
                needed = run.table.kv_needed()  # host bookkeeping once per chunk, not per step
                run.chunk_start = self._event()  # what a prefill beside this chunk may read is done by then
                for i in range(steps):
                    kv_len = self._kv_len(needed + i)
                    if use_graphs:
                        self._graph(key, view, kv_len).replay()
                    else:
                        self._step(view, kv_len)
                run.table.advance(steps)
                run.steps += steps
                run.slot_steps += steps * run.table.batch
                if refill_beside:  # the chunk is queued on the device: issue the prefill meanwhile
                    self._admit(run, prompts, budgets, active, beside_chunk=steps > 0)
                    run.timer.free = run.table.batch - len(run.table.live)
                    refill_beside = False
                finished = decoder.state.finished[: run.table.batch].tolist()  # the host sync
                run.in_flight.clear()  # the device is done with every staged prefill
                synced = self._time_chunk(run, steps, synced)
                slots, sequences = run.table.retire(finished)
                if slots:
                    out = decoder.outputs()
                    index, where = (torch.tensor(x, device=device) for x in (slots, sequences))
                    for name, values in results.items():
                        values.index_copy_(0, where, out[name][index])
                    buf.slot[index] = 0  # empty until refilled: its attention reads nothing
                if run.table.queue:
                    live = len(run.table.live)
                    if run.timer.due(run.table.batch - live, len(run.table.queue), live):
                        if overlaps_prefill and live:
                            refill_beside = True  # admitted behind the next chunk
                        else:
                            self._admit(run, prompts, budgets, active)
                    run.timer.free = run.table.batch - len(run.table.live)
                elif not run.table.live:
                    break
                elif (size := run.table.smaller_batch()) is not None:
                    self._compact(run, size)
            run.clock.mark()
        run.live_steps = int((results["authors"] != 0).sum())
        self._last_run = run
        return package_rollout(prompts, results, self.tokenizer, decoder.needs_senior)

    # ---------------------------------------------------------------------------- paged pool

    def _paged_table(self, prompts: PromptBatch, budgets: Tensor, capacity: int, buf: _Batch) -> PagedSlotTable:
        """The slot table of a paged ``generate``: a sequence's positions start at its own prompt
        (the longer of the two models' prompts: both read the same positions), not at the widest
        of its admission group, so no page holds another row's padding."""
        masks = [mask for _, mask in model_prompts(prompts).values()]
        prompt_tokens = torch.stack([m.sum(-1) for m in masks]).amax(0).tolist()
        pages = BlockManager(buf.pages, self.kv_page_size)
        longest = max(p + b for p, b in zip(prompt_tokens, budgets.tolist()))
        if pages.pages_for(longest) > pages.usable:
            raise ConfigError(
                f"the paged KV pool holds {pages.usable * self.kv_page_size} tokens, and a sequence of this batch "
                f"needs up to {longest} (prompt + max_new_tokens): raise kv_cache_tokens / kv_cache_gib"
            )
        buf.table.zero_()  # rows point at the scratch page until they hold a sequence
        return PagedSlotTable(list(range(prompts.batch_size)), capacity, budgets.tolist(), prompt_tokens, pages)

    def _reserve(self, run: _Run, steps: int) -> None:
        """Give every live sequence the pages of its next ``steps`` positions (preempted rows are
        emptied: their sequences wait at the front of the queue), then write the changed table rows."""
        preempted = run.table.reserve(steps)
        device = self._batch.slot.device
        if preempted:  # each keeps what it wrote: readmitted, it prefills those tokens and goes on
            slots = torch.tensor([slot for slot, _ in preempted], device=device)
            saved = run.decoder.save(slots)
            for i, written in enumerate(run.decoder.t[slots].tolist()):
                slot, sequence = preempted[i]
                run.paused[sequence] = ([x[i] for x in saved], run.decoder.tokens[slot, :written].clone())
                run.table.resume_later(sequence, written)
            run.decoder.state.finished[slots] = True
            self._batch.slot[slots] = 0  # empty until refilled: its attention reads nothing
        write_table_rows(self._batch.table, run.table.page_rows())
        pages = run.table.pages
        run.peak_pages = max(run.peak_pages, pages.usable - len(pages.free))

    def _admit(self, run: _Run, prompts: PromptBatch, budgets: Tensor, active: list[str],
               beside_chunk: bool = False) -> None:
        """Refill free slots from the queue: prefills of both models over the admitted prompts
        (left-padded among themselves, at most ``prefill_tokens`` padded positions a prefill),
        their caches copied into the freed rows. ``beside_chunk``: a decode chunk is queued on the
        device; on CUDA the prefills' forwards then run on the prefill stream beside it (they read
        weights and prompts only) and only their copies into the rows wait for it."""
        slots, sequences = run.table.admit()
        if not slots:
            return
        run.timer.refilled()
        stream = self._prefill_side() if beside_chunk and self._batch.slot.is_cuda else None
        if stream is not None:
            stream.wait_event(run.chunk_start)
        marks = run.beside if beside_chunk else run.prefills  # start/end of this refill's prefills
        with _on(stream):
            marks.append(self._event())
        starts = [run.table.start_tokens(s) if isinstance(run.table, PagedSlotTable) else 0 for s in sequences]
        parts = prefill_parts(starts, self.prefill_tokens)
        for n, part in enumerate(parts):
            with _on(stream):
                staged = self._prefill_forward(run, prompts, budgets, active, [slots[i] for i in part],
                                               [sequences[i] for i in part])
                if beside_chunk and n == len(parts) - 1:  # beside a chunk: the forwards' time
                    marks.append(self._event())
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
            self._place(run, staged)
            run.in_flight.append(staged)  # its tensors stay alive until the device has used them
        if not beside_chunk:  # the decode waits for all of it: forwards and copies
            marks.append(self._event())
        if run.steps:
            run.refills += 1
            run.refilled += len(slots)

    def _prefill_forward(self, run: _Run, prompts: PromptBatch, budgets: Tensor, active: list[str], slots: list[int],
                         sequences: list[int]) -> _Staged:
        """Everything of starting ``sequences`` in ``slots`` that touches no decode buffer: their
        inputs (new ones: their prompts; preempted ones: their prompts and the tokens they wrote),
        the index tensors, and each active model's forward over them."""
        device = self._batch.slot.device
        group = prompts.select(sequences)
        staged = _Staged(slots, sequences, torch.tensor(slots, device=device))
        inputs = model_prompts(group)
        paused = [run.paused.pop(s, None) for s in sequences]
        new = [i for i, saved in enumerate(paused) if saved is None]
        if new:
            index = torch.tensor(new, device=device)
            staged.new = (staged.rows[index], group.seeds[index.to(group.seeds.device)],
                          budgets[torch.tensor([sequences[i] for i in new], device=device)])
        if len(new) < len(sequences):
            back = [i for i, saved in enumerate(paused) if saved is not None]
            staged.resumed = (staged.rows[torch.tensor(back, device=device)],
                              [torch.stack(parts) for parts in zip(*(paused[i][0] for i in back))])
            responses = [saved[1] if saved is not None else None for saved in paused]
            inputs = {name: with_responses(ids, mask, responses) for name, (ids, mask) in inputs.items()}
            run.resumed_tokens += sum(paused[i][1].numel() for i in back)
        staged.width = width = inputs["senior"][0].shape[1]
        if self._batch.table is None:
            staged.last = [width - 1] * len(slots)
        else:  # paged: each row's positions start at its own prompt (its last `own` columns)
            own = [run.table.start_tokens(s) for s in sequences]
            held = [run.table.pages.held[s] for s in sequences]
            staged.placement = tuple(x.to(device) for x in prompt_placement(held, own, width, self.kv_page_size))
            staged.last = [tokens - 1 for tokens in own]
        staged.last_slot = torch.tensor(staged.last, device=device)
        for name in active:
            ids, mask = inputs[name]
            staged.masks[name] = mask
            staged.forwards[name] = self.models[name].prefill_forward(ids, mask)
        return staged

    def _place(self, run: _Run, staged: _Staged) -> None:
        """A staged prefill into its rows: decoder state, slots, positions, valid masks, logits and
        each model's caches (after any decode step already queued, which still saw the rows empty)."""
        buf, rows = self._batch, staged.rows
        if staged.new is not None:
            run.decoder.admit(*staged.new)
        if staged.resumed is not None:
            run.decoder.restore(*staged.resumed)
        buf.slot[rows] = staged.last_slot
        for name, (logits, cache) in staged.forwards.items():
            mask = staged.masks[name]
            buf.position[name][rows] = mask.sum(-1) - 1
            buf.valid[name][rows] = _valid_rows(mask, buf.slot[rows], staged.width, buf)
            buf.logits[name][rows] = logits.float()
            self.models[name].store_prefill(cache, rows, staged.placement)
        for slot, bound in zip(staged.slots, staged.last):
            run.table.bound[slot] = bound

    def _prefill_side(self) -> torch.cuda.Stream:
        if self._prefill_stream is None:
            self._prefill_stream = torch.cuda.Stream(device=self.models["senior"].device)
        return self._prefill_stream

    def _time_chunk(self, run: _Run, steps: int, synced: float) -> float:
        """After a chunk's host sync: hand the refill timer the chunk's step time (its wall time
        since the last sync, less the refill prefilled in it) and that prefill's time; for a
        prefill beside the chunk, what it added to the chunk's wall time over its steps at the last
        step time. Returns now."""
        now = time.perf_counter()
        if run.beside_timed < len(run.beside) // 2:
            run.beside_timed = len(run.beside) // 2
            run.timer.prefill_s = max(now - synced - steps * run.timer.step_s, 0.0)
            run.timer.observe(run.table.batch, steps, run.timer.step_s)
            return now
        prefill = 0.0
        if run.refills_timed < len(run.prefills) // 2:  # a prefill ran since the last sync (its marks are done)
            prefill = _seconds(*run.prefills[-2:])
            run.timer.prefill_s = prefill
            run.refills_timed = len(run.prefills) // 2
        if steps:
            run.timer.observe(run.table.batch, steps, max(now - synced - prefill, 0.0) / steps)
        return now

    def _compact(self, run: _Run, size: int) -> None:
        """Move the live rows to the first rows (both models, every per-row buffer) and decode
        ``size`` rows from now on: finished rows stop costing."""
        sources = torch.tensor(run.table.compact(size), device=self._batch.slot.device)
        for tensor in (*run.decoder.per_row(), *self._batch.per_row()):
            tensor[: len(sources)] = tensor[sources]
        for model in self.models.values():
            model.move_rows(sources)  # paged pools stay put: the table rows are rewritten before the next step
        run.decoder.state.finished[len(sources):].fill_(True)  # the rows left behind are empty
        run.compactions += 1

    def _event(self):
        return _mark(self._batch.slot.device.type == "cuda")

    def last_timing(self) -> dict[str, float]:
        """Where the last ``generate`` spent its time: setup seconds (cache allocation and graph
        capture: zero when both are reused), prefill seconds (every refill included), decode
        seconds and steps, the decode step time (prefills run beside decode chunks,
        ``prefill_beside_s`` of ``prefill_s``, are decode time too); ``busy_slot_fraction``: tokens written over the
        rows the steps paid for (live row-steps / decoded row-steps); refills (admissions after
        decoding started) and compactions; ``prompt_width``: the widest padded prompt. With
        ``kv_cache: paged`` also ``preemptions``, ``resumed_tokens`` (response tokens preempted
        sequences prefilled again to go on), ``kv_pool_tokens`` (positions the pool holds) and
        ``kv_pool_peak_fraction`` (the most of it held at once)."""
        run = self._last_run
        if run is None:
            raise RuntimeError("last_timing() reports on a generate() call; none has run yet")
        (total,) = run.clock.seconds()
        waited = sum(_seconds(a, b) for a, b in zip(run.prefills[::2], run.prefills[1::2]))
        beside = sum(_seconds(a, b) for a, b in zip(run.beside[::2], run.beside[1::2]))
        decode = total - waited
        return {
            "setup_s": run.setup_s, "prefill_s": waited + beside, "prefill_beside_s": beside,
            "decode_s": decode, "decode_steps": run.steps,
            "decode_step_ms": 1000 * decode / max(run.steps, 1),
            "busy_slot_fraction": run.live_steps / max(run.slot_steps, 1),
            "refills": run.refills, "refilled_sequences": run.refilled,
            "compactions": run.compactions, "prompt_width": run.width,
            **self._pool_timing(run),
        }

    def _pool_timing(self, run: _Run) -> dict[str, float]:
        if not isinstance(run.table, PagedSlotTable):
            return {}
        pages = run.table.pages
        return {"preemptions": run.table.preemptions, "resumed_tokens": run.resumed_tokens,
                "kv_pool_tokens": pages.usable * pages.page_size,
                "kv_pool_peak_fraction": run.peak_pages / pages.usable}

    def _kv_len(self, needed: int) -> int:
        if self.triton:  # the attention kernel reads its bound on the device: one graph for all steps
            return self._batch.length
        return min(math.ceil(needed / self.kv_block) * self.kv_block, self._batch.length)


def _mark(cuda: bool):
    """A point in time: a CUDA event recorded on the current stream, or the host clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Work issued inside runs on ``stream`` (None: where it would anyway)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def _seconds(start, end) -> float:
    """Between two ``_mark``s: CUDA events (recorded, and done) or host clocks."""
    return start.elapsed_time(end) / 1000 if isinstance(start, torch.cuda.Event) else end - start


def prefill_parts(starts: list[int], budget: int) -> list[list[int]]:
    """Admitted sequences (positions each starts with; 0: unknown, a prompt) in runs of at most
    ``budget`` padded positions (a run's rows x its longest), in admission order, each at least
    one sequence: a prefill of many resumed sequences would otherwise hold all their activations
    and keys at once."""
    parts: list[list[int]] = []
    longest = 0
    for i, tokens in enumerate(starts):
        if parts and (len(parts[-1]) + 1) * max(longest, tokens) <= budget:
            parts[-1].append(i)
            longest = max(longest, tokens)
        else:
            parts.append([i])
            longest = tokens
    return parts


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


def _valid_rows(mask: Tensor, last: Tensor, width: int, buf: _Batch) -> Tensor:  # [n, width], [n] -> [n, length] bool
    """Admitted rows' valid flags: prompt column ``width - 1 - last + p`` at position p (the row's
    last prompt token at slot ``last``), nothing after: a whole row, so nothing of the slot's last
    sequence stays visible."""
    if buf.table is None:  # slots: every row's prompt sits at [0, width)
        valid = torch.zeros(mask.shape[0], buf.length, dtype=torch.bool, device=mask.device)
        valid[:, :width] = mask.bool()
        return valid
    columns = torch.arange(buf.length, device=mask.device) + (width - 1 - last)[:, None]
    return mask.bool().gather(1, columns.clamp(max=width - 1)) & (columns < width)


@dataclass
class _Staged:
    """A prefill issued but not yet placed into its rows (``FastEngine._prefill_forward``)."""

    slots: list[int]
    sequences: list[int]
    rows: Tensor  # the slots, on the device
    new: tuple[Tensor, Tensor, Tensor] | None = None  # rows, seeds, budgets of new sequences
    resumed: tuple[Tensor, list[Tensor]] | None = None  # rows and saved decoder rows of preempted ones
    width: int = 0  # the prefilled columns
    last: list[int] = field(default_factory=list)  # each row's slot of its last prefilled token
    last_slot: Tensor | None = None  # the same, on the device
    placement: tuple[Tensor, Tensor] | None = None  # paged: where the prompt K/V go in the pool
    masks: dict[str, Tensor] = field(default_factory=dict)  # per model: its attention mask
    forwards: dict[str, tuple[Tensor, object]] = field(default_factory=dict)  # per model: logits, cache


class _Run:
    """The bookkeeping of one ``generate``: the decoder, the slot table, and what timing reports."""

    def __init__(self, decoder: TandemDecoder, table: SlotTable, clock: _PhaseClock, timer: RefillTimer):
        self.decoder, self.table, self.clock, self.timer = decoder, table, clock, timer
        self.prefills: list = []  # start/end marks of every prefill the decode waited for
        self.refills_timed = 1  # prefills whose time the timer has had (the first admission: not a refill)
        self.beside: list = []  # start/end marks of the forwards of prefills run beside a decode chunk
        self.beside_timed = 0
        self.chunk_start = None  # a mark queued before the current chunk's steps
        self.in_flight: list[_Staged] = []  # staged prefills the device may still read
        self.setup_s = 0.0
        self.steps = self.slot_steps = self.live_steps = 0
        self.refills = self.compactions = 0
        self.refilled = 0  # sequences admitted by refills
        # preempted sequence -> (its saved decoder rows, ``per_row`` order; the tokens it wrote)
        self.paused: dict[int, tuple[list[Tensor], Tensor]] = {}
        self.resumed_tokens = 0  # response tokens prefilled again when preempted sequences resumed
        self.width = 0
        self.peak_pages = 0  # paged pool: the most pages held at once
