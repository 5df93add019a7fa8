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


def batch_ladder(capacity: int, step: int = 8) -> list[int]:
    """Batch sizes a decode step is captured for, ascending: 1, 2, 4, then multiples of ``step``
    below ``capacity``, then ``capacity`` itself. Rungs ``step`` apart, not powers of two: a
    batch that waits for half its rows to finish before shrinking pays for up to half of it idle
    (77% of the row-steps were live at 64 lognormal sequences on an H200, power-of-two rungs)."""
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
