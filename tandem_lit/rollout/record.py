"""The records that cross module boundaries: prompts going into an engine, rollouts coming out.

Authorship is data: every completion token carries an ``Author`` code from the sampler to the
loss, so the objective can weight junior-written tokens explicitly and can refuse to run when the
codes are missing (fail closed, never silently plain RL).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum

import torch
from torch import Tensor

# the per-token switch codes, kept on the host (``Rollout.start_set``)
HOST_CODES = ("start_set", "end_set")

@dataclass
class KeptCache:
    """One model's keys and values of a paused sequence, moved to host memory (``StopRule.keep_caches``):
    the pages of a paged KV pool that held its positions [0, ``positions``), and the model's
    next-token logits, so resuming needs no prefill of this model."""

    positions: int  # prompt + written tokens: what the pages hold
    keys: list[Tensor]  # per layer: [pages, kv_heads, page_size, head_dim], host (pinned where there is a GPU)
    values: list[Tensor]
    logits: Tensor  # [vocab] float32: the distribution of the sequence's next token


@dataclass
class PausedSequence:
    """A sequence an engine stopped before its end (``StopRule``), with everything it wrote: the
    tokens and their authors, and the decoder's state of its row (``TandemDecoder.pause``: its
    step counter, so its RNG draws, span and switch state, per-token log-probs and switch codes).
    Given back in ``PromptBatch.resume``, the engine prefills its prompt and ``tokens`` and goes on
    exactly where it stopped. ``state`` None: admitted nowhere yet (nothing written). ``caches``:
    the models whose keys and values were kept (``StopRule.keep_caches``): those are not prefilled
    again but copied back."""

    written: int  # response tokens written so far
    tokens: Tensor  # [written] long
    authors: Tensor  # [written] int8 Author codes
    state: list[Tensor] | None = None  # the decoder's per-row buffers of this sequence (host copies)
    caches: dict[str, KeptCache] | None = None  # model name -> its kept keys and values


@dataclass
class StopRule:
    """When a ``generate`` call may end before every row has ended (partial rollouts): once
    ``groups`` of the call's prompt groups have every one of their rows ended, and every row of
    ``must_finish`` has. The rows still running are then paused (``Rollout.paused``)."""

    group: list[int]  # per row of the call: its prompt group
    groups: int  # complete groups wanted (<= 0: none)
    must_finish: list[bool] | None = None  # per row: it may not be paused
    # the models whose keys and values the engine keeps for the paused rows (host memory), to be
    # copied back when they resume instead of prefilled (an engine whose ``why_no_kept_caches`` is None)
    keep_caches: tuple[str, ...] = ()

    def reached(self, ended: list[bool]) -> bool:
        """``ended``: per row of the call, whether it has ended."""
        if self.must_finish is not None and not all(e for e, m in zip(ended, self.must_finish) if m):
            return False
        if self.groups <= 0:
            return True
        open_groups = {g for g, e in zip(self.group, ended) if not e}
        return len(set(self.group) - open_groups) >= self.groups


class Author(IntEnum):
    """Who wrote a token. Stored as int8 in ``Rollout.author``."""

    PAD = 0
    PROMPT = 1
    SENIOR = 2
    JUNIOR = 3


@dataclass
class PromptBatch:
    """Left-padded prompt token ids, one row per rollout (prompts already repeated per generation)."""

    input_ids: Tensor  # [B, P] long, left-padded with pad_token_id
    attention_mask: Tensor  # [B, P] long, 0 on padding
    seeds: Tensor  # [B] long, per-sequence RNG seed (sampling and handoff draws)
    # the same prompts encoded for the junior, when it has its own tokenizer (text-level handoff)
    partner: PromptBatch | None = None
    # [B] long, each row's own token budget (None: sampling.max_new_tokens for every row). Real
    # RL responses are long-tailed; benchmarks force such lengths on models that never end.
    max_new_tokens: Tensor | None = None
    # per row: a paused sequence to go on with (None: start afresh), from ``Rollout.paused`` of an
    # earlier call (``RolloutEngine.pauses``); its budget still counts the tokens it wrote
    resume: list[PausedSequence | None] | None = None

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.attention_mask.shape:
            raise ValueError(
                f"prompt input_ids {tuple(self.input_ids.shape)} and attention_mask "
                f"{tuple(self.attention_mask.shape)} differ in shape"
            )
        if self.seeds.shape != (self.input_ids.shape[0],):
            raise ValueError(f"seeds must have shape [{self.input_ids.shape[0]}], got {tuple(self.seeds.shape)}")
        if self.input_ids.shape[1] == 0 or bool((self.attention_mask.sum(-1) == 0).any()):
            raise ValueError("every prompt needs at least one token")
        if self.max_new_tokens is not None and self.max_new_tokens.shape != self.seeds.shape:
            raise ValueError(
                f"max_new_tokens must have shape [{self.batch_size}], got {tuple(self.max_new_tokens.shape)}"
            )
        if self.resume is not None and len(self.resume) != self.batch_size:
            raise ValueError(f"resume must have {self.batch_size} entries, got {len(self.resume)}")

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def budgets(self, limit: int) -> Tensor:  # [B] long, on the seeds' device
        """Each row's token budget; ``limit`` is ``sampling.max_new_tokens``, the most any row may have."""
        if self.max_new_tokens is None:
            return torch.full_like(self.seeds, limit)
        budgets = self.max_new_tokens.to(device=self.seeds.device, dtype=torch.long)
        if budgets.numel() and not (1 <= int(budgets.min()) and int(budgets.max()) <= limit):
            raise ValueError(
                f"PromptBatch.max_new_tokens must lie in 1..{limit} (sampling.max_new_tokens), "
                f"got {int(budgets.min())}..{int(budgets.max())}"
            )
        return budgets

    def to(self, device: torch.device | str) -> PromptBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            seeds=self.seeds.to(device),
            partner=self.partner.to(device) if self.partner is not None else None,
            max_new_tokens=self.max_new_tokens.to(device) if self.max_new_tokens is not None else None,
        )

    def select(self, index: Tensor | list[int]) -> PromptBatch:
        """Some rows, in the order of ``index`` (the partner's and the budgets with them). Columns
        that are padding in every picked row are dropped, so a group prefills at its own width."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.input_ids.device)
        mask = self.attention_mask[index]
        first = int(mask.bool().any(0).long().argmax()) if mask.numel() else 0
        return PromptBatch(
            input_ids=self.input_ids[index, first:],
            attention_mask=mask[:, first:],
            seeds=self.seeds[index.to(self.seeds.device)],
            partner=self.partner.select(index) if self.partner is not None else None,
            max_new_tokens=self.max_new_tokens[index.to(self.max_new_tokens.device)]
            if self.max_new_tokens is not None else None,
            resume=[self.resume[i] for i in index.tolist()] if self.resume is not None else None,
        )

    @property
    def resumes(self) -> bool:
        """True when some row goes on with tokens it wrote in an earlier call."""
        return self.resume is not None and any(p is not None and p.state is not None for p in self.resume)


@dataclass
class Rollout:
    """A batch of finished rollouts. Completions are right-padded; ``author`` is PAD after the end."""

    prompt_ids: Tensor  # [B, P] long, left-padded
    prompt_mask: Tensor  # [B, P] long
    completion_ids: Tensor  # [B, T] long, right-padded with pad_token_id
    author: Tensor  # [B, T] int8 Author codes: SENIOR / JUNIOR, PAD after the end
    finished: Tensor  # [B] bool, ended with an end-of-sequence token
    truncated: Tensor  # [B] bool, stopped without one (token budget, or the handoff span limit)
    handoffs: Tensor  # [B] long, number of author switches inside the completion
    decisions: Tensor  # [B] long, number of handoff draws (boundaries reached, plus the first span)
    junior_draws: Tensor  # [B] long, how many of those draws picked the junior
    texts: list[str] = field(default_factory=list)  # decoded completions (special tokens removed)
    # [B, T] float32: the senior's log-prob of each appended token at the sampling temperature,
    # as the engine computed it (None when the senior did not run, e.g. junior-only rollouts),
    # under the distribution the token was drawn from (``rollout.switch``); TextHandoffEngine
    # records the senior's own tokens only (0 at the junior's re-encoded ones)
    senior_logprobs: Tensor | None = None
    # [B, T] int8 switch codes, 1-based rows of ``token_sets`` (0: none): ``start_set``, the set a
    # token was drawn from after a switch; ``end_set``, the set the senior's discarded candidate
    # came from where its span ended at this position (its mass scores the token before). None,
    # with ``token_sets`` [K, V] bool: no draw of these rollouts was restricted (``rollout.switch``).
    # The codes live on the host, wherever the rest is: the update finds the few switch positions
    # there, so projecting only those positions never waits for the device (``logprobs.switch_terms``)
    start_set: Tensor | None = None
    end_set: Tensor | None = None
    token_sets: Tensor | None = None
    # partial rollouts: per row, the paused sequence when a ``StopRule`` ended the call before the
    # row ended (None: it ended); None: no row was paused
    paused: list[PausedSequence | None] | None = None
    # [B, T] long: policy updates between the senior weights that wrote each token and the ones
    # this step's update starts from (0: fresh; junior tokens and padding are 0). None: all fresh
    staleness: Tensor | None = None

    @property
    def completion_mask(self) -> Tensor:  # [B, T] bool, True on written tokens
        return self.author != Author.PAD

    @property
    def lengths(self) -> Tensor:  # [B] long
        return self.completion_mask.sum(-1)

    def junior_token_share(self) -> float:
        written = self.completion_mask.sum().item()
        return (self.author == Author.JUNIOR).sum().item() / written if written else 0.0

    def select(self, index: Tensor | list[int], rows: list[int] | None = None) -> Rollout:
        """Rows of this batch (a micro-batch, or the rollouts of kept groups). ``rows``: the same
        rows as a host list, where the caller has one: reading a CUDA ``index`` back (for
        ``texts``) waits for the GPU."""
        if rows is None:
            rows = index if isinstance(index, list) else index.tolist()
        index = torch.as_tensor(index, dtype=torch.long, device=self.completion_ids.device)
        picked = {
            name: getattr(self, name)[index]
            for name in (
                "prompt_ids", "prompt_mask", "completion_ids", "author", "finished",
                "truncated", "handoffs", "decisions", "junior_draws",
            )
        }
        device_tokens = [name for name in PER_TOKEN if name not in HOST_CODES]
        per_token = {name: getattr(self, name)[index] if getattr(self, name) is not None else None for name in device_tokens}
        host_rows = torch.as_tensor(rows, dtype=torch.long)
        per_token.update({name: getattr(self, name)[host_rows] if getattr(self, name) is not None else None
                          for name in HOST_CODES})
        paused = [self.paused[i] for i in rows] if self.paused is not None else None
        return Rollout(**picked, texts=[self.texts[i] for i in rows], **per_token, token_sets=self.token_sets, paused=paused)

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollouts on ``device`` (host copies travel between ranks: a pickled CUDA tensor
        would come back on the sender's GPU)."""
        moved = {name: value.to(device) for name, value in vars(self).items()
                 if isinstance(value, Tensor) and name not in HOST_CODES}
        return replace(self, **moved)

    def trimmed(self, first: int | None = None, width: int | None = None) -> Rollout:
        """The same rows without columns that are padding in every row (prompt columns on the
        left, completion columns on the right): a micro-batch's forward pays for its own longest
        sequence, not the whole batch's. ``first`` (the first prompt column kept) and ``width``
        (completion columns kept), when the caller knows them from host copies of the lengths:
        reading them here is a device sync."""
        if first is None:
            first = int(self.prompt_mask.bool().any(0).long().argmax()) if self.prompt_mask.numel() else 0
        if width is None:
            width = max(int(self.lengths.max()) if self.lengths.numel() else 0, 1)
        per_token = {name: getattr(self, name)[:, :width] if getattr(self, name) is not None else None
                     for name in PER_TOKEN}
        return replace(
            self,
            prompt_ids=self.prompt_ids[:, first:],
            prompt_mask=self.prompt_mask[:, first:],
            completion_ids=self.completion_ids[:, :width],
            author=self.author[:, :width],
            **per_token,
        )

    def spans(self, row: int, tokenizer) -> list[tuple[Author, str]]:
        """The completion of one row as (author, text) spans, for logs a person can read."""
        ids = self.completion_ids[row].tolist()
        authors = self.author[row].tolist()
        spans: list[tuple[Author, list[int]]] = []
        for token, author in zip(ids, authors):
            if author == Author.PAD:
                break
            if spans and spans[-1][0] == author:
                spans[-1][1].append(token)
            else:
                spans.append((Author(author), [token]))
        return [(author, tokenizer.decode(tokens)) for author, tokens in spans]


#: the optional [B, T] per-token fields of a Rollout (they move with its rows and columns)
PER_TOKEN = ("senior_logprobs", "start_set", "end_set", "staleness")


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts from several engine calls, padding prompts (left) and completions (right)."""

    def pad_to(tensors: list[Tensor], width: int, value: int, left: bool) -> Tensor:
        padded = []
        for t in tensors:
            extra = width - t.shape[1]
            pad = (extra, 0) if left else (0, extra)
            padded.append(torch.nn.functional.pad(t, pad, value=value))
        return torch.cat(padded)

    prompt_width = max(p.prompt_ids.shape[1] for p in parts)
    completion_width = max(p.completion_ids.shape[1] for p in parts)
    logprobs = None
    if all(p.senior_logprobs is not None for p in parts):
        logprobs = pad_to([p.senior_logprobs for p in parts], completion_width, 0, left=False)
    tables = [p.token_sets for p in parts if p.token_sets is not None]
    if any(not torch.equal(t, tables[0]) for t in tables[1:]):
        raise ValueError("rollouts with different handoff token sets cannot be stacked (their switch codes differ)")
    codes = {}
    for name in ("start_set", "end_set"):
        codes[name] = pad_to([getattr(p, name).cpu() if getattr(p, name) is not None else torch.zeros(p.author.shape, dtype=torch.int8)
                              for p in parts], completion_width, 0, left=False) if tables else None
    staleness = None
    if any(p.staleness is not None for p in parts):
        staleness = pad_to([p.staleness if p.staleness is not None else torch.zeros_like(p.author, dtype=torch.long)
                            for p in parts], completion_width, 0, left=False)
    return Rollout(
        prompt_ids=pad_to([p.prompt_ids for p in parts], prompt_width, pad_token_id, left=True),
        prompt_mask=pad_to([p.prompt_mask for p in parts], prompt_width, 0, left=True),
        completion_ids=pad_to([p.completion_ids for p in parts], completion_width, pad_token_id, left=False),
        author=pad_to([p.author for p in parts], completion_width, int(Author.PAD), left=False),
        finished=torch.cat([p.finished for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        handoffs=torch.cat([p.handoffs for p in parts]),
        decisions=torch.cat([p.decisions for p in parts]),
        junior_draws=torch.cat([p.junior_draws for p in parts]),
        texts=[t for p in parts for t in p.texts],
        senior_logprobs=logprobs,
        **codes,
        token_sets=tables[0] if tables else None,
        staleness=staleness,
    )
