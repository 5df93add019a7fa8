"""The host side of the paged KV cache: which pages of the pool each sequence holds.

With ``FastEngine(kv_cache="paged")`` the keys/values of every model live in one pool of
fixed-size pages per layer (``[pages, kv_heads, page_size, head_dim]``), and each decode row
reads its sequence's positions through a row of the block table (logical page -> pool page). Both
models of a pair share the table: a sequence's token positions are the same in both, only each
model's pool holds its own bytes per token (the layout SGLang's speculative decoding uses for
draft and target). So memory is bounded by the tokens in use, not rows x (prompt + cap).

``BlockManager`` hands out pages, plain Python like ``scheduler.SlotTable``: a sequence's prompt
pages at admission, one more page when it crosses a page boundary, all back when it finishes or is
preempted. Page 0 is never handed out: it is the scratch page every unused table entry points at,
so rows that keep stepping after their sequence stopped (or that hold none) write there, never
into another sequence's pages. Admission keeps a small watermark of free pages (vLLM's
``watermark=0.01``), so a new sequence does not take the page a running one needs next.
The two functions below turn its lists into the tensors the engine writes: block-table rows and
where an admission's prefilled keys/values go.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

SCRATCH_PAGE = 0


class BlockManager:
    """``pages`` pages of ``page_size`` token positions (page 0 reserved as scratch)."""

    def __init__(self, pages: int, page_size: int, watermark: float = 0.01):
        if pages < 2 or page_size < 1:
            raise ValueError(f"a paged pool needs at least 2 pages of at least 1 token, got {pages} x {page_size}")
        self.page_size = page_size
        self.pages = pages
        self.free: deque[int] = deque(range(1, pages))
        self.held: dict[int, list[int]] = {}  # sequence id -> its pages, in position order
        self.watermark = int(watermark * (pages - 1))

    @property
    def usable(self) -> int:
        """Pages a sequence may ever hold (all but the scratch page)."""
        return self.pages - 1

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_admit(self, tokens: int, alone: bool = False) -> bool:
        """Whether a sequence of ``tokens`` prompt positions fits and leaves the watermark free
        (``alone``: nothing else is live, so the watermark protects nobody)."""
        return len(self.free) >= self.pages_for(tokens) + (0 if alone else self.watermark)

    def allocate(self, sequence: int, tokens: int) -> list[int]:
        """Pages for positions [0, tokens) of a newly admitted sequence."""
        if sequence in self.held:
            raise ValueError(f"sequence {sequence} already holds pages")
        need = self.pages_for(tokens)
        if need > len(self.free):
            raise ValueError(f"{need} pages asked, {len(self.free)} free")
        self.held[sequence] = [self.free.popleft() for _ in range(need)]
        return self.held[sequence]

    def grow(self, sequence: int, tokens: int) -> int | None:
        """Cover positions [0, tokens) of a running sequence: the pages added (0: it already had
        them), or None when too few are free (nothing is taken then)."""
        pages = self.held[sequence]
        extra = self.pages_for(tokens) - len(pages)
        if extra <= 0:
            return 0
        if extra > len(self.free):
            return None
        pages.extend(self.free.popleft() for _ in range(extra))
        return extra

    def release(self, sequence: int) -> None:
        self.free.extend(self.held.pop(sequence))


def write_table_rows(table: Tensor, rows: dict[int, list[int]]) -> None:
    """Rewrite rows of the device block table ``table`` [capacity, pages per row] (one copy):
    each row's pages, then the scratch page."""
    if not rows:
        return
    padded = [pages + [SCRATCH_PAGE] * (table.shape[1] - len(pages)) for pages in rows.values()]
    index = torch.tensor(list(rows), device=table.device)
    table[index] = torch.tensor(padded, dtype=table.dtype).to(table.device)


def prompt_placement(held: list[list[int]], own: list[int], width: int, page_size: int) -> tuple[Tensor, Tensor]:
    """Where an admission's prefilled keys/values go: (flat index into the group's B x ``width``
    prompt positions, flat pool position) of every kept token. Row i keeps its last ``own[i]``
    columns (its own prompt; the rest is padding to the group's width) as positions [0, own[i]),
    in its pages ``held[i]``."""
    rows = len(held)
    kept = torch.tensor(own)
    pages = torch.tensor([p + [SCRATCH_PAGE] * (max(map(len, held)) - len(p)) for p in held])  # [n, most pages]
    j = torch.arange(width)
    keep = j[None, :] < kept[:, None]
    source = torch.arange(rows)[:, None] * width + (width - kept)[:, None] + j[None, :]
    page = pages.gather(1, (j // page_size).clamp(max=pages.shape[1] - 1).expand(rows, -1))
    return source[keep], (page * page_size + j % page_size)[keep]
