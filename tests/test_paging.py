"""The paged KV cache's host bookkeeping: ``paging.BlockManager`` (pages per sequence) and
``scheduler.PagedSlotTable`` (admission by free pages, growth before each chunk, preemption of the
newest sequence, compaction). Plain Python: the engine tests check the rollouts."""

from __future__ import annotations

import pytest

from tandem_lit.rollout.static.paging import SCRATCH_PAGE, BlockManager
from tandem_lit.rollout.static.scheduler import PagedSlotTable


def test_prompt_pages_at_admission_never_the_scratch_page():
    pages = BlockManager(pages=10, page_size=4, watermark=0)
    held = pages.allocate(7, tokens=9)  # positions 0..8: three pages
    assert len(held) == 3 and SCRATCH_PAGE not in held
    assert len(pages.free) == 9 - 3 and pages.usable == 9
    assert pages.allocate(8, tokens=4) == [4] and pages.held[7] == [1, 2, 3]
    with pytest.raises(ValueError):
        pages.allocate(7, tokens=1)  # a sequence is admitted once


def test_a_sequence_grows_one_page_when_it_crosses_a_boundary():
    pages = BlockManager(pages=10, page_size=4, watermark=0)
    pages.allocate(0, tokens=3)
    assert pages.grow(0, tokens=4) == 0  # position 3 still in the first page
    assert pages.grow(0, tokens=5) == 1 and len(pages.held[0]) == 2  # position 4 starts the second
    assert pages.grow(0, tokens=8) == 0
    assert pages.grow(0, tokens=13) == 2  # a chunk of steps may cross two boundaries at once


def test_growth_that_does_not_fit_takes_nothing():
    pages = BlockManager(pages=4, page_size=2, watermark=0)
    pages.allocate(0, tokens=4)  # 2 of 3 usable pages
    assert pages.grow(0, tokens=8) is None  # needs 2 more, 1 free
    assert len(pages.held[0]) == 2 and len(pages.free) == 1


def test_released_pages_are_reused():
    pages = BlockManager(pages=4, page_size=2, watermark=0)
    first = pages.allocate(0, tokens=6)
    assert not pages.can_admit(1)
    pages.release(0)
    assert 0 not in pages.held and sorted(pages.free) == [1, 2, 3]
    assert sorted(pages.allocate(1, tokens=6)) == sorted(first)


def test_admission_keeps_the_watermark_unless_nothing_else_runs():
    pages = BlockManager(pages=201, page_size=1)  # 200 usable pages, watermark 1% = 2
    assert pages.watermark == 2
    assert pages.can_admit(198) and not pages.can_admit(199)
    assert pages.can_admit(200, alone=True) and not pages.can_admit(201, alone=True)


def table(prompt_tokens, budgets, capacity, pages, page_size=4):
    return PagedSlotTable(list(range(len(prompt_tokens))), capacity, budgets, prompt_tokens,
                          BlockManager(pages, page_size, watermark=0))


def test_admission_is_first_come_first_served_by_free_pages():
    t = table(prompt_tokens=[8, 12, 2], budgets=[5, 5, 5], capacity=3, pages=6)  # 5 usable pages
    assert t.admit() == ([0, 1], [0, 1])  # 2 + 3 pages; the third finds none left
    assert list(t.queue) == [2]
    t = table(prompt_tokens=[8, 16, 2], budgets=[5, 5, 5], capacity=3, pages=6)
    assert t.admit() == ([0], [0])  # the second needs 4 pages, 3 are free: the third waits behind it
    assert list(t.queue) == [1, 2]


def test_admission_fills_every_free_slot_while_pages_last():
    t = table(prompt_tokens=[4, 4, 4, 4], budgets=[5] * 4, capacity=3, pages=10)
    assert t.admit() == ([0, 1, 2], [0, 1, 2])
    assert t.page_rows() == {0: [1], 1: [2], 2: [3]}
    assert t.page_rows() == {}  # written once


def test_reserve_grows_every_live_sequence_for_the_chunk_up_to_its_budget():
    t = table(prompt_tokens=[4, 4], budgets=[2, 20], capacity=2, pages=10)
    t.admit()
    t.page_rows()
    for slot in (0, 1):
        t.bound[slot] = 3  # the engine sets each row's last prompt position
    assert t.reserve(steps=8) == []
    # sequence 0 writes positions 4, 5 (its budget), sequence 1 positions 4..11
    assert len(t.pages.held[0]) == 2 and len(t.pages.held[1]) == 3
    assert set(t.page_rows()) == {0, 1}


def test_the_newest_sequence_is_preempted_and_queued_first():
    t = table(prompt_tokens=[4, 4, 4], budgets=[30, 30, 30], capacity=3, pages=5, page_size=4)  # 4 usable
    assert t.admit() == ([0, 1, 2], [0, 1, 2])
    t.queue.append(9)  # someone already waiting stays behind the preempted one
    for slot in range(3):
        t.bound[slot] = 3
    # each needs a second page for the next 4 steps; one page is free: the oldest takes it, the
    # second preempts the newest (slot 2) and takes its page; the newest has nothing to do
    assert t.reserve(steps=4) == [(2, 2)]
    assert t.held == [0, 1, -1] and list(t.queue) == [2, 9]
    assert t.preemptions == 1 and 2 not in t.pages.held
    assert t.page_rows()[2] == []  # the emptied row points at the scratch page only


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    t = table(prompt_tokens=[4, 4], budgets=[30, 30], capacity=2, pages=4, page_size=4)  # 3 usable
    t.admit()
    t.bound[0] = t.bound[1] = 3
    t.pages.grow(0, 8)  # the oldest already took the free page
    assert t.reserve(steps=4) == [(1, 1)]  # the newest cannot grow and nobody newer exists
    assert t.held == [0, -1] and list(t.queue) == [1]


def test_a_preempted_sequence_is_readmitted_with_the_tokens_it_wrote():
    """Readmitted, it needs the pages of its prompt and of what it wrote, and only the rest of its
    budget: it goes on, it does not start again."""
    t = table(prompt_tokens=[4, 4], budgets=[30, 30], capacity=2, pages=10, page_size=4)  # 9 usable
    t.admit()
    t.bound[0] = t.bound[1] = 3
    t.pages.grow(0, 24)  # the oldest holds 6 pages, the newest 1: 2 free
    assert t.reserve(steps=12) == [(1, 1)]
    t.resume_later(1, written=9)  # the engine read its step counter
    assert t.start_tokens(1) == 13 and t.start_tokens(0) == 4
    t.retire([True, False])  # the oldest ends: all pages free again
    assert t.admit() == ([0], [1])
    assert len(t.pages.held[1]) == 4 and t.left[0] == 30 - 9  # positions 0..12; 21 tokens to go


def test_retire_frees_pages_and_compaction_rewrites_every_row():
    t = table(prompt_tokens=[4, 4, 4], budgets=[5, 5, 5], capacity=3, pages=10)
    t.admit()
    t.page_rows()
    assert t.retire([True, False, False]) == ([0], [0])
    assert 0 not in t.pages.held and t.page_rows() == {0: []}
    t.queue.clear()
    sources = t.compact(2)
    assert sources == [1, 2] and t.held[:2] == [1, 2]
    assert t.admitted[:2] == [2, 3]  # admission order moves with the rows (preemption reads it)
    rows = t.page_rows()
    assert set(rows) == {0, 1, 2} and rows[2] == []  # the row left behind points nowhere
    assert rows[0] == t.pages.held[1]
