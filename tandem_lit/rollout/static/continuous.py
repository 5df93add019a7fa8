"""One FastEngine ``generate`` as a queue: admission, prefill, retirement, compaction, preemption.

FastEngine (``engine.py``) owns what outlives a call: the static buffers both models share, the
decoders and the captured decode steps. A ``ContinuousRun`` owns one call's queue of sequences:

- decode chunks of ``check_every`` steps (a step is the engine's: a graph replay on CUDA);
- after each chunk one host sync: finished sequences are retired (their rows copied out), freed
  slots are refilled from the queue when the refill timer says so (one batched prefill of both
  models, its caches copied into the freed rows), and once the queue is empty the live rows are
  compacted into the next smaller captured batch size, so finished rows stop costing;
- with a paged pool, the pages of the next chunk's positions are reserved first; a sequence that
  needs a page when none is free is preempted (it keeps its tokens and decoder state, and resumes
  by prefilling its prompt and them);
- a ``StopRule`` ends the call early: the sequences still running are paused, and with
  ``keep_caches`` their pages of the named models go to host memory (``KeptCache``); resumed in a
  later call, those pages are copied back into the pool instead of prefilled again;
- where the time went (``timing``): prefills, decode, busy share, refills, compactions, the pool.

A sequence depends on its own seed only, never on its slot, its neighbours or when it was
admitted: everything on the device is per row, and the host only decides which row holds what.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from tandem_lit.errors import ConfigError, DeviceMemoryError
from tandem_lit.rollout.decoder import TandemDecoder
from tandem_lit.rollout.engine import EngineTiming, model_prompts, with_responses  # noqa: F401 (tests import it here)
from tandem_lit.rollout.record import KeptCache, PausedSequence, PromptBatch, StopRule
from tandem_lit.rollout.static.paging import BlockManager, prompt_placement, write_table_rows
from tandem_lit.rollout.static.scheduler import PagedSlotTable, RefillTimer, SlotTable


@dataclass
class RunSettings:
    """The engine's settings a run reads (see ``FastEngine``'s arguments of the same names)."""

    check_every: int
    refill: str
    overlap_prefill: str
    prefill_tokens: int
    page_size: int


class ContinuousRun:
    """The bookkeeping and the host loop of one ``generate`` over ``buffers`` (the engine's
    ``_Batch``: per-row slots, positions, valid masks, logits, block table) and ``models`` (the
    static decoders, by name)."""

    def __init__(self, buffers, models: dict, decoder: TandemDecoder, table: SlotTable, settings: RunSettings,
                 prefill_stream: Callable[[], torch.cuda.Stream]):
        self.buf, self.models, self.decoder, self.table = buffers, models, decoder, table
        self.settings = settings
        self.prefill_stream = prefill_stream  # the engine's, made on first use
        self.cuda = buffers.slot.is_cuda
        self.clock = _PhaseClock(self.cuda)
        self.timer = RefillTimer(settings.refill)
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
        # paged: positions the prefills' forwards ran over, and as padded (rows x a prefill's widest)
        self.prefill_positions = self.prefill_padded_positions = 0
        self.ended: list[bool] = []  # per sequence: it ended (retired)
        self.stopped = False  # a StopRule ended the run
        self.paused_out: dict[int, PausedSequence] = {}  # after a stop: sequence -> what it wrote
        self.kept: dict[int, dict[str, KeptCache]] = {}  # resumed sequence -> its kept caches, until admitted
        self.kept_positions = 0  # positions of paused sequences whose caches went to host memory
        self.keep_s = 0.0  # the time that took (host clock: the copies end in a sync)
        self.restored_positions = 0  # positions of resumed sequences copied back instead of prefilled
        self.width = 0
        self.peak_pages = 0  # paged pool: the most pages held at once
        self.active: list[str] = []  # the models the policy runs

    # -------------------------------------------------------------------------------- the loop

    def decode(self, prompts: PromptBatch, budgets: Tensor, active: list[str],
               step: Callable[[TandemDecoder, int], None], kv_len: Callable[[int], int],
               stop: StopRule | None = None) -> dict[str, Tensor]:
        """Decode every sequence of ``prompts`` (``active``: the models the policy runs) with
        ``step(view, kv_len)``, one decode step of rows ``[0, view.batch_size)``. Returns the
        decoder's outputs, one row per sequence. ``stop``: end once it is reached, the sequences
        still running or waiting paused (``paused_sequences``). Sequences of ``prompts.resume``
        wait as preempted ones do: admitted, they prefill their tokens and go on."""
        decoder, table, buf = self.decoder, self.table, self.buf
        if prompts.resumes:
            for sequence, paused in enumerate(prompts.resume):
                if paused is not None and paused.state is not None:
                    state = [x.to(buf.slot.device) for x in decoder.fit_state(paused.state)]
                    self.paused[sequence] = (state, paused.tokens.to(buf.slot.device))
                    if paused.caches:  # taken, not shared: restored, their host memory goes back to the allocator
                        self.kept[sequence], paused.caches = paused.caches, None
        self.ended = [False] * prompts.batch_size
        self.stopped = False
        decoder.vacate()
        self.active = active
        buf.attended.zero_()  # (the graphs' warm-up steps added to it)
        results = {name: torch.zeros((prompts.batch_size, *x.shape[1:]), dtype=x.dtype, device=buf.slot.device)
                   for name, x in decoder.outputs().items()}
        self.clock.mark()
        self._admit(prompts, budgets, active)
        self.timer.free = table.batch - len(table.live)  # a paged pool may admit fewer
        synced = time.perf_counter()
        refill_beside = False  # a refill decided after the last chunk, prefilled beside this one
        while True:
            view = decoder.narrow(table.batch)
            steps = min(self.settings.check_every, table.steps_left())
            if buf.table is not None:  # pages for this chunk's positions (may preempt)
                self._reserve(steps)
                steps = min(steps, table.steps_left())
            needed = table.kv_needed()  # host bookkeeping once per chunk, not per step
            self.chunk_start = self._mark()  # what a prefill beside this chunk may read is done by then
            for i in range(steps):
                step(view, kv_len(needed + i))
            table.advance(steps)
            self.steps += steps
            self.slot_steps += steps * table.batch
            if refill_beside:  # the chunk is queued on the device: issue the prefill meanwhile
                self._admit(prompts, budgets, active, beside_chunk=steps > 0)
                self.timer.free = table.batch - len(table.live)
                refill_beside = False
            finished = decoder.state.finished[: table.batch].tolist()  # the host sync
            self.in_flight.clear()  # the device is done with every staged prefill
            synced = self._time_chunk(steps, synced)
            self._retire(finished, results)
            if stop is not None and stop.reached(self.ended):
                self._pause(results, tuple(name for name in stop.keep_caches if name in active))
                break
            if table.queue:
                live = len(table.live)
                if self.timer.due(table.batch - live, len(table.queue), live):
                    if self.settings.overlap_prefill == "on" and live:
                        refill_beside = True  # admitted behind the next chunk
                    else:
                        self._admit(prompts, budgets, active)
                self.timer.free = table.batch - len(table.live)
            elif not table.live:
                break
            elif (size := table.smaller_batch()) is not None:
                self._compact(size)
        self.clock.mark()
        # tokens written in this call: resumed sequences' earlier tokens were not decoded here
        earlier = sum(p.written for p in prompts.resume or [] if p is not None and p.state is not None)
        self.live_steps = int((results["authors"] != 0).sum()) - earlier
        return results

    def _retire(self, finished: list[bool], results: dict[str, Tensor]) -> None:
        """Copy the rows of sequences that ended into ``results`` and empty their slots."""
        slots, sequences = self.table.retire(finished)
        for sequence in sequences:
            self.ended[sequence] = True
        if not slots:
            return
        device = self.buf.slot.device
        out = self.decoder.outputs()
        index, where = (torch.tensor(x, device=device) for x in (slots, sequences))
        for name, values in results.items():
            values.index_copy_(0, where, out[name][index])
        self.buf.slot[index] = 0  # empty until refilled: its attention reads nothing

    def _compact(self, size: int) -> None:
        """Move the live rows to the first rows (both models, every per-row buffer) and decode
        ``size`` rows from now on: finished rows stop costing."""
        sources = torch.tensor(self.table.compact(size), device=self.buf.slot.device)
        for tensor in (*self.decoder.per_row(), *self.buf.per_row()):
            tensor[: len(sources)] = tensor[sources]
        for model in self.models.values():
            model.move_rows(sources)  # paged pools stay put: the table rows are rewritten before the next step
        self.decoder.state.finished[len(sources):].fill_(True)  # the rows left behind are empty
        self.compactions += 1

    def _pause(self, results: dict[str, Tensor], keep: tuple[str, ...]) -> None:
        """A ``StopRule`` is reached: the sequences in slots are paused (saved, their rows copied
        into ``results`` as they stand; the caches of the models in ``keep`` to host memory),
        those waiting keep what they had (nothing, or what a preemption saved, or caches kept by an
        earlier call); ``paused_sequences`` hands them all back."""
        self.stopped = True
        live = self.table.live
        device = self.buf.slot.device
        if live:
            index = torch.tensor(live, device=device)
            where = torch.tensor([self.table.held[s] for s in live], device=device)
            out = self.decoder.outputs()
            for name, values in results.items():
                values.index_copy_(0, where, out[name][index])
            paused = self.decoder.pause(index)
            started = time.perf_counter()
            kept = self._keep_caches(live, [p.written for p in paused], keep)
            self.keep_s = time.perf_counter() - started if keep else 0.0
            for slot, sequence, caches in zip(live, paused, kept):
                sequence.caches = caches
                self.paused_out[self.table.held[slot]] = sequence
        for sequence, (saved, tokens) in self.paused.items():  # preempted, or resumed and not readmitted
            state = [x.cpu() for x in saved]
            self.paused_out[sequence] = PausedSequence(tokens.numel(), tokens.cpu(), state[4][: tokens.numel()].clone(), state,
                                                       caches=self.kept.pop(sequence, None))
            for name, column in (("tokens", 3), ("authors", 4), ("logprobs", 5), ("start_sets", 6), ("end_sets", 7)):
                results[name][sequence] = saved[column][: results[name].shape[1]].to(results[name].dtype)
        for sequence in self.table.queue:
            if sequence not in self.paused_out:  # never admitted: nothing written
                self.paused_out[sequence] = PausedSequence(0, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.int8))

    def _keep_caches(self, slots: list[int], written: list[int], names: tuple[str, ...]) -> list[dict[str, KeptCache] | None]:
        """The paged pool's pages that hold the positions of the sequences in ``slots`` (each its
        prompt and ``written`` tokens), for each model of ``names``, copied to host memory with
        the model's next-token logits: per slot, model name -> ``KeptCache`` (None: none kept)."""
        if not names or not slots:
            return [None] * len(slots)
        table = self.table
        sequences = [table.held[s] for s in slots]
        positions = [table.prompt_tokens[q] + n for q, n in zip(sequences, written)]
        counts = [table.pages.pages_for(p) for p in positions]
        pages = torch.tensor([page for q, c in zip(sequences, counts) for page in table.pages.held[q][:c]],
                             device=self.buf.slot.device)
        starts = [0, *itertools.accumulate(counts)][:-1]
        kept: list[dict[str, KeptCache]] = [{} for _ in slots]
        for name in names:
            try:
                keys, values = self.models[name].save_pages(pages)
            except RuntimeError as err:  # pinned host memory ran out (cudaHostAlloc)
                if "out of memory" not in str(err):
                    raise
                gib = len(pages) * self.table.pages.page_size * self.models[name].kv_bytes_per_token() / 1024**3
                raise DeviceMemoryError(
                    f"host memory ran out keeping the paused sequences' {name} caches for the update ({gib:.1f} GiB): "
                    "set rollout.partial.keep_caches: junior (one model's) or none (prefilled again instead)") from err
            logits = self.buf.logits[name][torch.tensor(slots, device=pages.device)].cpu()
            for i, (start, count) in enumerate(zip(starts, counts)):
                kept[i][name] = KeptCache(positions[i], [k[start : start + count] for k in keys],
                                          [v[start : start + count] for v in values], logits[i])
        self.kept_positions += sum(positions)
        return kept

    def paused_sequences(self, rows: int) -> list[PausedSequence | None]:
        """Per sequence: the paused one, or None where it ended (after a stopped ``decode``)."""
        return [self.paused_out.get(i) for i in range(rows)]

    # ---------------------------------------------------------------------------- paged pool

    def _reserve(self, steps: int) -> None:
        """Give every live sequence the pages of its next ``steps`` positions (preempted rows are
        emptied: their sequences wait at the front of the queue), then write the changed table rows."""
        table, decoder = self.table, self.decoder
        preempted = table.reserve(steps)
        if preempted:  # each keeps what it wrote: readmitted, it prefills those tokens and goes on
            slots = torch.tensor([slot for slot, _ in preempted], device=self.buf.slot.device)
            saved = decoder.save(slots)
            for i, written in enumerate(decoder.t[slots].tolist()):
                slot, sequence = preempted[i]
                self.paused[sequence] = ([x[i] for x in saved], decoder.tokens[slot, :written].clone())
                table.resume_later(sequence, written)
            decoder.state.finished[slots] = True
            self.buf.slot[slots] = 0  # empty until refilled: its attention reads nothing
        write_table_rows(self.buf.table, table.page_rows())
        pages = table.pages
        self.peak_pages = max(self.peak_pages, pages.usable - len(pages.free))

    # -------------------------------------------------------------------------------- prefill

    def _admit(self, prompts: PromptBatch, budgets: Tensor, active: list[str], beside_chunk: bool = False) -> None:
        """Refill free slots from the queue: prefills of both models over the admitted prompts
        (left-padded among themselves, at most ``prefill_tokens`` padded positions a prefill),
        their caches copied into the freed rows. ``beside_chunk``: a decode chunk is queued on the
        device; on CUDA the prefills' forwards then run on the prefill stream beside it (they read
        weights and prompts only) and only their copies into the rows wait for it."""
        slots, sequences = self.table.admit()
        if not slots:
            return
        self.timer.refilled()
        stream = self.prefill_stream() if beside_chunk and self.cuda else None
        if stream is not None:
            stream.wait_event(self.chunk_start)
        marks = self.beside if beside_chunk else self.prefills  # start/end of this refill's prefills
        with _on(stream):
            marks.append(self._mark())
        paged = isinstance(self.table, PagedSlotTable)
        starts = [self.table.start_tokens(s) if paged else 0 for s in sequences]
        # sequences with kept caches in parts of their own: those models' forwards skip them
        kinds = [[i for i, s in enumerate(sequences) if (s in self.kept) == kept] for kept in (False, True)]
        parts = [[kind[j] for j in part] for kind in kinds if kind
                 for part in prefill_parts([starts[i] for i in kind], self.settings.prefill_tokens)]
        for n, part in enumerate(parts):
            with _on(stream):
                staged = self._prefill_forward(prompts, budgets, active, [slots[i] for i in part],
                                               [sequences[i] for i in part])
                if beside_chunk and n == len(parts) - 1:  # beside a chunk: the forwards' time
                    marks.append(self._mark())
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
            self._place(staged)
            if stream is not None:  # read on another stream: its tensors stay alive until the device has used them
                self.in_flight.append(staged)
            # (on this stream the allocator orders their reuse after the copies: each part's staging
            # caches are freed before the next part's prefill, so a refill holds one part's at a time)
            del staged
        if not beside_chunk:  # the decode waits for all of it: forwards and copies
            marks.append(self._mark())
        if self.steps:
            self.refills += 1
            self.refilled += len(slots)

    def _prefill_forward(self, prompts: PromptBatch, budgets: Tensor, active: list[str], slots: list[int],
                         sequences: list[int]) -> _Staged:
        """Everything of starting ``sequences`` in ``slots`` that touches no decode buffer: their
        inputs (new ones: their prompts; preempted ones: their prompts and the tokens they wrote),
        the index tensors, and each active model's forward over them."""
        device = self.buf.slot.device
        group = prompts.select(sequences)
        staged = _Staged(slots, sequences, torch.tensor(slots, device=device))
        inputs = model_prompts(group)
        kept = [self.kept.pop(s, None) for s in sequences]  # all or none (``_admit``'s parts)
        paused = [self.paused.pop(s, None) for s in sequences]
        new = [i for i, saved in enumerate(paused) if saved is None]
        resumed_tokens = sum(saved[1].numel() for saved in paused if saved is not None)
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
        staged.width = width = inputs["senior"][0].shape[1]
        if self.buf.table is None:
            staged.last = [width - 1] * len(slots)
        else:  # paged: each row's positions start at its own prompt (its last `own` columns)
            own = [self.table.start_tokens(s) for s in sequences]
            held = [self.table.pages.held[s] for s in sequences]
            placement = prompt_placement(held, own, width, self.settings.page_size)
            staged.placement = tuple(x.to(device) for x in placement)
            staged.last = [tokens - 1 for tokens in own]
        staged.last_slot = torch.tensor(staged.last, device=device)
        for name in active:
            ids, mask = inputs[name]
            staged.masks[name] = mask
            if kept[0] is not None and name in kept[0]:
                staged.kept[name] = [k[name] for k in kept]
            else:
                staged.forwards[name] = self.models[name].prefill_forward(ids, mask)
        if staged.forwards:  # some model prefilled the resumed ones again
            self.resumed_tokens += resumed_tokens
            if self.buf.table is not None:
                self.prefill_positions += sum(own)
                self.prefill_padded_positions += len(sequences) * width
        if kept[0] is not None:
            self.restored_positions += sum(self.table.start_tokens(s) for s in sequences)
        return staged

    def _place(self, staged: _Staged) -> None:
        """A staged prefill into its rows: decoder state, slots, positions, valid masks, logits and
        each model's caches (after any decode step already queued, which still saw the rows empty)."""
        buf, rows = self.buf, staged.rows
        if staged.new is not None:
            self.decoder.admit(*staged.new)
        if staged.resumed is not None:
            self.decoder.restore(*staged.resumed)
        buf.slot[rows] = staged.last_slot
        for name in (*staged.forwards, *staged.kept):
            mask = staged.masks[name]
            buf.position[name][rows] = mask.sum(-1) - 1
            buf.valid[name][rows] = _valid_rows(mask, buf.slot[rows], staged.width, buf)
        for name, (logits, cache) in staged.forwards.items():
            buf.logits[name][rows] = logits.float()
            self.models[name].store_prefill(cache, rows, staged.placement)
        for name, caches in staged.kept.items():
            buf.logits[name][rows] = torch.stack([c.logits for c in caches]).to(rows.device)
        for i, sequence in enumerate(staged.sequences if staged.kept else ()):  # into the pages admission gave them
            pages = self.table.pages.held[sequence]
            index = torch.tensor(pages, device=rows.device)
            for name, caches in staged.kept.items():
                if len(pages) != len(caches[i].keys[0]):
                    raise RuntimeError(f"sequence {sequence} was admitted with {len(pages)} pages for the "
                                       f"{len(caches[i].keys[0])} its kept cache holds")
                self.models[name].load_pages(caches[i].keys, caches[i].values, index)
        for slot, bound in zip(staged.slots, staged.last):
            self.table.bound[slot] = bound

    # --------------------------------------------------------------------------------- timing

    def _mark(self):
        return _mark(self.cuda)

    def _time_chunk(self, steps: int, synced: float) -> float:
        """After a chunk's host sync: hand the refill timer the chunk's step time (its wall time
        since the last sync, less the refill prefilled in it) and that prefill's time; for a
        prefill beside the chunk, what it added to the chunk's wall time over its steps at the last
        step time. Returns now."""
        now = time.perf_counter()
        timer = self.timer
        if self.beside_timed < len(self.beside) // 2:
            self.beside_timed = len(self.beside) // 2
            timer.prefill_s = max(now - synced - steps * timer.step_s, 0.0)
            timer.observe(self.table.batch, steps, timer.step_s)
            return now
        prefill = 0.0
        if self.refills_timed < len(self.prefills) // 2:  # a prefill ran since the last sync (its marks are done)
            prefill = _seconds(*self.prefills[-2:])
            timer.prefill_s = prefill
            self.refills_timed = len(self.prefills) // 2
        if steps:
            timer.observe(self.table.batch, steps, max(now - synced - prefill, 0.0) / steps)
        return now

    def decode_read_bytes(self) -> int | None:
        """What this call's decode steps read, every active model (None where one does not count it)."""
        attended = int(self.buf.attended)  # (a sync, once the call is over)
        parts = [self.models[name].decode_bytes(attended, self.steps) for name in self.active]
        return None if not parts or None in parts else sum(parts)

    def timing(self) -> EngineTiming:
        """See ``FastEngine.last_timing``."""
        (total,) = self.clock.seconds()
        waited = sum(_seconds(a, b) for a, b in zip(self.prefills[::2], self.prefills[1::2]))
        beside = sum(_seconds(a, b) for a, b in zip(self.beside[::2], self.beside[1::2]))
        timing = EngineTiming(
            setup_s=self.setup_s, prefill_s=waited + beside, prefill_beside_s=beside,
            decode_s=total - waited - self.keep_s, decode_steps=self.steps, prompt_width=self.width,
            busy_slot_fraction=self.live_steps / max(self.slot_steps, 1), written_tokens=self.live_steps,
            refills=self.refills, refilled_sequences=self.refilled, compactions=self.compactions,
            decode_read_bytes=self.decode_read_bytes(),
        )
        if isinstance(self.table, PagedSlotTable):
            pages = self.table.pages
            timing = replace(timing, preemptions=self.table.preemptions, resumed_tokens=self.resumed_tokens,
                             kept_positions=self.kept_positions, restored_positions=self.restored_positions,
                             keep_s=self.keep_s, prefill_positions=self.prefill_positions,
                             prefill_padded_positions=self.prefill_padded_positions,
                             kv_pool_tokens=pages.usable * pages.page_size,
                             kv_pool_peak_fraction=self.peak_pages / pages.usable)
        return timing


def paged_table(prompts: PromptBatch, budgets: Tensor, capacity: int, table: Tensor, pool_pages: int,
                page_size: int) -> PagedSlotTable:
    """The slot table of a paged ``generate`` (``table``: the block table buffer, reset here): a
    sequence's positions start at its own prompt (the longer of the two models' prompts: both read
    the same positions), not at the widest of its admission group, so no page holds another row's
    padding. Raises ConfigError when one sequence alone cannot fit the pool."""
    masks = [mask for _, mask in model_prompts(prompts).values()]
    prompt_tokens = torch.stack([m.sum(-1) for m in masks]).amax(0).tolist()
    pages = BlockManager(pool_pages, page_size)
    longest = max(p + b for p, b in zip(prompt_tokens, budgets.tolist()))
    if pages.pages_for(longest) > pages.usable:
        raise ConfigError(
            f"the paged KV pool holds {pages.usable * page_size} tokens, and a sequence of this batch "
            f"needs up to {longest} (prompt + max_new_tokens): raise kv_cache_tokens / kv_cache_gib"
        )
    table.zero_()  # rows point at the scratch page until they hold a sequence
    return PagedSlotTable(list(range(prompts.batch_size)), capacity, budgets.tolist(), prompt_tokens, pages)


def prefill_parts(starts: list[int], budget: int) -> list[list[int]]:
    """Admitted sequences (positions each starts with; 0: unknown, a prompt) in runs of at most
    ``budget`` padded positions (a run's rows x its longest), each at least one sequence: a
    prefill of many resumed sequences would otherwise hold all their activations and keys at once.
    Longest first, so that sequences of like length share a run: resumed sequences come back at
    every length up to the cap, and in admission order a run pads every row to the longest that
    happens to be in it (counted over simulated admissions at issue 54's lengths, about twice the
    positions; in a measured step the prefill took as long either way, being arithmetic-bound:
    dev/log.md, 2026-12-08). Which run a sequence is prefilled in changes nothing it writes."""
    parts: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(starts)), key=lambda i: -starts[i]):
        tokens = starts[i]
        if parts and (len(parts[-1]) + 1) * max(longest, tokens) <= budget:
            parts[-1].append(i)
            longest = max(longest, tokens)
        else:
            parts.append([i])
            longest = tokens
    return parts


def _valid_rows(mask: Tensor, last: Tensor, width: int, buf) -> Tensor:  # [n, width], [n] -> [n, length] bool
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
    """A prefill issued but not yet placed into its rows (``ContinuousRun._prefill_forward``)."""

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
    kept: dict[str, list[KeptCache]] = field(default_factory=dict)  # per model not prefilled: each row's kept cache


class _PhaseClock:
    """Marks points of one ``generate`` without a host sync (CUDA events; the host clock on CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list = []

    def mark(self) -> None:
        self.marks.append(_mark(self.cuda))

    def seconds(self) -> list[float]:
        """Time between consecutive marks (waits for the last one on CUDA)."""
        if self.cuda:
            self.marks[-1].synchronize()
        return [_seconds(a, b) for a, b in zip(self.marks, self.marks[1:])]


def _mark(cuda: bool):
    """A point in time: a CUDA event recorded on the current stream, or the host clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start, end) -> float:
    """Between two ``_mark``s: CUDA events (recorded, and done) or host clocks."""
    return start.elapsed_time(end) / 1000 if isinstance(start, torch.cuda.Event) else end - start


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Work issued inside runs on ``stream`` (None: where it would anyway)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
