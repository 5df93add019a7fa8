"""The host side of continuous batching: which sequence each decode slot holds, who waits, and
which captured batch size the live rows fit in.

FastEngine decodes a step's rollouts as a queue. At most ``capacity`` sequences decode at once;
every ``check_every`` steps the host reads the finished flags, retires finished sequences, admits
waiting ones into the freed slots, and, once nobody waits, compacts the live rows into the next
smaller size of the ladder (one CUDA graph per size), so finished rows stop costing. Only plain
Python here: the engine moves the tensors.
"""

from __future__ import annotations

from collections import deque

from tandem_lit.rollout.static.paging import BlockManager


def batch_ladder(capacity: int, step: int = 8) -> list[int]:
    """Batch sizes a decode step is captured for, ascending: 1, 2, 4, then multiples of ``step``
    below ``capacity``, then ``capacity`` itself. Rungs ``step`` apart, not powers of two: a
    batch that waits for half its rows to finish before shrinking pays for up to half of it idle
    (a quarter of the row-steps went idle at 64 lognormal sequences with power-of-two rungs: dev/log.md)."""
    sizes = [size for size in (1, 2, 4) if size < min(step, capacity)]
    sizes += range(step, capacity, step)
    return [*sizes, capacity]


class SlotTable:
    """Slots 0..capacity-1, the sequence each holds (-1: empty), and the waiting queue.

    The engine decodes slots ``[0, batch)``; compaction keeps every live sequence below ``batch``.
    ``bound[s]`` is an upper bound on slot ``s``'s newest cache position, so the torch path knows
    how much of the cache a step must attend to without asking the device; ``left[s]`` is how many
    more steps its budget allows at most, so no step runs once every live row is surely done.
    """

    def __init__(self, order: list[int], capacity: int, budgets: list[int]):
        self.queue = deque(order)  # sequence ids, in admission order
        self.budgets = budgets  # per sequence id
        self.capacity = capacity
        self.ladder = batch_ladder(capacity)
        self.batch = capacity
        self.held = [-1] * capacity
        self.bound = [0] * capacity
        self.left = [0] * capacity

    @property
    def live(self) -> list[int]:
        """Slots holding a sequence (finished or not: the host has not retired it yet)."""
        return [s for s in range(self.batch) if self.held[s] >= 0]

    def admit(self) -> tuple[list[int], list[int]]:
        """Fill free slots below ``batch`` from the queue: (slots, sequence ids)."""
        free = [s for s in range(self.batch) if self.held[s] < 0]
        taken = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        slots = free[: len(taken)]
        for slot, sequence in zip(slots, taken):
            self.held[slot] = sequence
            self.left[slot] = self.budgets[sequence]
        return slots, taken

    def retire(self, finished: list[bool]) -> tuple[list[int], list[int]]:
        """Empty the slots whose sequence finished (``finished``: flags of slots [0, batch)):
        (slots, sequence ids) whose results the engine collects."""
        slots = [s for s in range(self.batch) if self.held[s] >= 0 and finished[s]]
        sequences = [self.held[s] for s in slots]
        for slot in slots:
            self.held[slot] = -1
        return slots, sequences

    def smaller_batch(self) -> int | None:
        """The smallest ladder size the live rows fit in, when nobody waits and it is smaller."""
        if self.queue:
            return None
        size = next(size for size in self.ladder if size >= max(len(self.live), 1))
        return size if size < self.batch else None

    def compact(self, size: int) -> list[int]:
        """Move the live sequences to slots [0, n) and decode ``size`` rows from now on; returns the
        source slot of each destination slot (the engine moves the row tensors the same way)."""
        sources = self.live
        self.held = [self.held[s] for s in sources] + [-1] * (self.capacity - len(sources))
        self.bound = [self.bound[s] for s in sources] + [0] * (self.capacity - len(sources))
        self.left = [self.left[s] for s in sources] + [0] * (self.capacity - len(sources))
        self.batch = size
        return sources

    def kv_needed(self) -> int:
        """Cache positions the next step attends to: one past the furthest live slot's new token."""
        return max((self.bound[s] for s in self.live), default=0) + 2

    def steps_left(self) -> int:
        """Steps until every live row has surely stopped (its budget; an end token may come sooner)."""
        return max((self.left[s] for s in self.live), default=0)

    def advance(self, steps: int) -> None:
        for s in range(self.batch):
            self.bound[s] += steps
            self.left[s] -= steps


class RefillTimer:
    """When freed slots are refilled from the queue: as soon as they free up (``eager``), or once
    the decode time they have cost reaches one prefill's (``amortized``, the default).

    A refill's prefill costs about as much for one prompt as for eight: at a few prompts it is
    kernel launches, not FLOPs (thousands of small ones through Hugging Face's Qwen3.5 stack:
    for the 9B, as long as several decode steps of a full batch), while an empty slot costs
    1/batch of each step it stays empty. Refilled as they freed up, a step's long-tailed rollouts
    of the 9B/2B pair spent a sizeable share of the run in refills' prefills (dev/log.md).
    ``amortized`` lets free slots wait until the
    step time they have idled since the last refill adds up to the last refill's prefill time,
    then refills them together: the ski-rental rule, never worse than twice the best schedule in
    hindsight. It refills at once when every waiting sequence fits, when no slot is live, and
    before any prefill time is known. Sequences do not depend on when they are admitted, so the
    rule changes speed only."""

    def __init__(self, mode: str):
        self.eager = mode == "eager"
        self.free = 0  # slots left empty at the last decision: they idle through the next chunk
        self.idle_s = 0.0  # decode time those empty slots have cost since the last refill
        self.slot_chunk_s = 0.0  # what one empty slot costs over a chunk (the last chunk's step time / batch)
        self.step_s = 0.0  # the last chunk's step time
        self.prefill_s: float | None = None  # the last refill's prefill time

    def observe(self, batch: int, steps: int, step_s: float) -> None:
        """A chunk of ``steps`` decode steps of ``step_s`` seconds has run, ``self.free`` of its
        ``batch`` rows empty."""
        self.step_s = step_s
        self.slot_chunk_s = steps * step_s / batch
        self.idle_s += self.free * self.slot_chunk_s

    def due(self, free: int, waiting: int, live: int) -> bool:
        """Refill now? ``free`` empty slots, ``waiting`` queued sequences, ``live`` held slots.
        Yes once waiting one more chunk would take the idle cost past a prefill's (looking one
        chunk ahead, so the idle paid overshoots a prefill by less than a chunk's)."""
        if not free or not waiting:
            return False
        if self.eager or self.prefill_s is None or live == 0 or free >= waiting:
            return True
        return self.idle_s + free * self.slot_chunk_s >= self.prefill_s

    def refilled(self) -> None:
        self.idle_s = 0.0


class PagedSlotTable(SlotTable):
    """A ``SlotTable`` whose sequences also hold pages of a paged KV pool (``paging.BlockManager``).

    A queued sequence is admitted only when the pages of the positions it starts with are free
    (above the watermark); before each chunk of ``steps`` decode steps, ``reserve`` gives every
    live sequence the pages its next positions need, oldest first, preempting the newest sequences
    when none are free (their pages freed, back to the front of the queue). A preempted sequence
    keeps the tokens it wrote (``resume_later``): readmitted, it starts from its prompt and those
    tokens, prefilled at once (vLLM's recompute preemption), not decoded again. ``changed`` holds
    the slots whose table row the engine must rewrite before the next step.
    """

    def __init__(self, order: list[int], capacity: int, budgets: list[int], prompt_tokens: list[int],
                 pages: BlockManager):
        super().__init__(order, capacity, budgets)
        self.prompt_tokens = prompt_tokens  # per sequence id: positions its prompt takes
        self.written = [0] * len(prompt_tokens)  # per sequence id: tokens it wrote before it was preempted
        self.pages = pages
        self.admitted = [0] * capacity  # admission count of each slot's sequence: the newest is preempted first
        self.admissions = 0
        self.preemptions = 0
        self.changed: set[int] = set()

    def admit(self) -> tuple[list[int], list[int]]:
        slots, taken = [], []
        for slot in range(self.batch):
            if not self.queue:
                break
            if self.held[slot] >= 0:
                continue
            sequence = self.queue[0]
            if not self.pages.can_admit(self.start_tokens(sequence), alone=not self.live):
                break  # first come, first served: nobody overtakes the head of the queue
            self.queue.popleft()
            self.pages.allocate(sequence, self.start_tokens(sequence))
            self.held[slot], self.left[slot] = sequence, self.budgets[sequence] - self.written[sequence]
            self.admissions += 1
            self.admitted[slot] = self.admissions
            self.changed.add(slot)
            slots.append(slot)
            taken.append(sequence)
        return slots, taken

    def retire(self, finished: list[bool]) -> tuple[list[int], list[int]]:
        slots, sequences = super().retire(finished)
        for slot, sequence in zip(slots, sequences):
            self.pages.release(sequence)
            self.changed.add(slot)
        return slots, sequences

    def start_tokens(self, sequence: int) -> int:
        """Positions a sequence holds when it is admitted: its prompt, and the tokens it wrote
        before a preemption."""
        return self.prompt_tokens[sequence] + self.written[sequence]

    def resume_later(self, sequence: int, written: int) -> None:
        """A preempted sequence had written ``written`` tokens: it is readmitted with them."""
        self.written[sequence] = written

    def reserve(self, steps: int) -> list[tuple[int, int]]:
        """Pages for the next ``steps`` positions of every live sequence (up to its budget); the
        (slot, sequence) pairs preempted to make room (the slots now empty, the sequences queued)."""
        preempted: list[tuple[int, int]] = []
        for slot in sorted(self.live, key=lambda s: self.admitted[s]):
            if self.held[slot] < 0:
                continue  # preempted by an older sequence of this pass
            tokens = self.bound[slot] + min(steps, self.left[slot]) + 1
            while (added := self.pages.grow(self.held[slot], tokens)) is None:
                victim = max(self.live, key=lambda s: self.admitted[s])
                preempted.append((victim, self.held[victim]))
                self._preempt(victim)
                if victim == slot:
                    break
            if added:
                self.changed.add(slot)
        return preempted

    def _preempt(self, slot: int) -> None:
        sequence = self.held[slot]
        self.pages.release(sequence)
        self.queue.appendleft(sequence)
        self.held[slot] = -1
        self.changed.add(slot)
        self.preemptions += 1

    def compact(self, size: int) -> list[int]:
        sources = super().compact(size)
        self.admitted = [self.admitted[s] for s in sources] + [0] * (self.capacity - len(sources))
        self.changed = set(range(self.capacity))  # rows moved, and rows left behind must point nowhere
        return sources

    def page_rows(self) -> dict[int, list[int]]:
        """The changed slots' pages (empty: the slot holds no sequence); clears ``changed``."""
        rows = {s: list(self.pages.held[self.held[s]]) if self.held[s] >= 0 else [] for s in sorted(self.changed)}
        self.changed.clear()
        return rows
