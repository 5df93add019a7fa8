"""The per-token tandem logic every engine shares: sample, draw an author at boundaries, record.

Engines differ only in how they produce the two models' next-token logits (a Hugging Face loop
with dynamic caches, static caches replayed as a CUDA graph, ...). Everything that decides which
token is appended and who wrote it lives here, as pure tensor ops on preallocated buffers, so the
same seed gives the same rollout in every engine and the step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem_lit.rollout.handoff import HandoffPolicy, TokenClasses
from tandem_lit.rollout.record import Author, PromptBatch, Rollout
from tandem_lit.rollout.sampling import SamplingConfig, sample_tokens, uniform

# RNG streams: independent uniforms per (sequence, step)
_CANDIDATE, _HANDOFF, _SWITCH, _FIRST_AUTHOR = 0, 1, 2, 3


@dataclass
class DecodeState:
    """Per-sequence decoding state, all [B] tensors on the decoding device."""

    author: Tensor  # long, author of the current span (SENIOR / JUNIOR)
    span_len: Tensor  # long, tokens written in the current span
    carry: Tensor  # long, the boundary rule's state (e.g. trailing line breaks)
    finished: Tensor  # bool, an end-of-sequence token was appended
    handoffs: Tensor  # long, author switches
    decisions: Tensor  # long, author draws
    junior_draws: Tensor  # long, draws that picked the junior


class TandemDecoder:
    """Chooses and records one token per sequence per step, given both models' logits."""

    def __init__(
        self,
        policy: HandoffPolicy,
        classes: TokenClasses,
        sampling: SamplingConfig,
        seeds: Tensor,  # [B] long
        eos_token_ids: list[int],
        pad_token_id: int,
    ):
        device = seeds.device
        batch = seeds.shape[0]
        self.policy = policy
        self.rule = policy.compile(classes)
        self.vocab_size = classes.vocab_size
        self.sampling = sampling
        self.seeds = seeds
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
        self.pad_token_id = pad_token_id
        self.only_author = policy.only_author
        self.tokens = torch.full((batch, sampling.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.authors = torch.zeros((batch, sampling.max_new_tokens), dtype=torch.int8, device=device)
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        first, drawn = self._first_author(batch, device)
        self.state = DecodeState(
            author=first,
            span_len=zeros.clone(),
            carry=zeros.clone(),
            finished=torch.zeros(batch, dtype=torch.bool, device=device),
            handoffs=zeros.clone(),
            decisions=drawn.long(),
            junior_draws=(drawn & (first == Author.JUNIOR)).long(),
        )

    @property
    def needs_senior(self) -> bool:
        return self.only_author != Author.JUNIOR

    @property
    def needs_junior(self) -> bool:
        return self.only_author != Author.SENIOR

    def _first_author(self, batch: int, device) -> tuple[Tensor, Tensor]:
        if self.policy.first_author == "draw":
            junior = uniform(self.seeds, 0, _FIRST_AUTHOR) < self.policy.p
            return torch.where(junior, int(Author.JUNIOR), int(Author.SENIOR)), torch.ones(batch, dtype=torch.bool, device=device)
        fixed = Author.JUNIOR if self.policy.first_author == "junior" else Author.SENIOR
        return torch.full((batch,), int(fixed), dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.bool, device=device)

    def _logits_of(self, author: Tensor, senior: Tensor | None, junior: Tensor | None) -> Tensor:
        if junior is None:
            return senior
        if senior is None:
            return junior
        return torch.where((author == Author.JUNIOR).unsqueeze(-1), junior, senior)

    def step(self, t: Tensor | int, senior_logits: Tensor | None, junior_logits: Tensor | None) -> Tensor:
        """Append token ``t`` of every sequence and return it.  # logits [B, V'] -> [B] long

        ``t`` may be a device tensor, so that the step can be replayed from a CUDA graph.
        """
        s = self.state
        v = self.vocab_size
        senior = senior_logits[:, :v] if senior_logits is not None else None
        junior = junior_logits[:, :v] if junior_logits is not None else None
        candidate = sample_tokens(self._logits_of(s.author, senior, junior), uniform(self.seeds, t, _CANDIDATE), self.sampling)
        if self.only_author is None:
            token, author = self._handoff(t, candidate, senior, junior)
        else:
            token, author = candidate, s.author
            s.span_len += 1
        live = ~s.finished
        token = torch.where(live, token, self.pad_token_id)
        code = torch.where(live, author, int(Author.PAD)).to(torch.int8)
        index = torch.as_tensor(t, device=token.device).reshape(1)
        self.tokens.index_copy_(1, index, token.unsqueeze(1))
        self.authors.index_copy_(1, index, code.unsqueeze(1))
        s.carry = self.rule.update(s.carry, token)
        s.finished = s.finished | torch.isin(token, self.eos)
        return token

    def _handoff(self, t, candidate: Tensor, senior: Tensor, junior: Tensor) -> tuple[Tensor, Tensor]:
        s = self.state
        boundary = self.rule.at_boundary(s.carry, candidate) & (s.span_len > 0)
        allowed = self.rule.start_allowed(s.carry)
        if self.policy.max_span is not None:
            forced = s.span_len >= self.policy.max_span
            boundary = boundary | forced
            if allowed is not None:  # a forced draw may start mid-word: no constraint there
                allowed = allowed | forced.unsqueeze(-1)
        drawn = torch.where(uniform(self.seeds, t, _HANDOFF) < self.policy.p, int(Author.JUNIOR), int(Author.SENIOR))
        new_author = torch.where(boundary, drawn, s.author)
        switched = new_author != s.author
        switch_token = sample_tokens(self._logits_of(new_author, senior, junior), uniform(self.seeds, t, _SWITCH), self.sampling, allowed)
        live = ~s.finished
        s.decisions += (boundary & live).long()
        s.junior_draws += (boundary & live & (drawn == Author.JUNIOR)).long()
        s.handoffs += (switched & live).long()
        s.span_len = torch.where(switched, 1, s.span_len + 1)
        s.author = new_author
        return torch.where(switched, switch_token, candidate), new_author

    def all_finished(self) -> bool:
        return bool(self.state.finished.all())

    def finish(self, prompts: PromptBatch, tokenizer, steps_taken: int) -> Rollout:
        """Package the buffers as a Rollout (trimmed to the longest completion)."""
        lengths = (self.authors[:, :steps_taken] != Author.PAD).sum(-1)
        width = max(int(lengths.max().item()) if lengths.numel() else 0, 1)
        tokens = self.tokens[:, :width]
        authors = self.authors[:, :width]
        texts = [
            tokenizer.decode(row[: int(n)].tolist(), skip_special_tokens=True)
            for row, n in zip(tokens.cpu(), lengths.cpu())
        ]
        s = self.state
        return Rollout(
            prompt_ids=prompts.input_ids,
            prompt_mask=prompts.attention_mask,
            completion_ids=tokens.clone(),
            author=authors.clone(),
            finished=s.finished.clone(),
            truncated=~s.finished,
            handoffs=s.handoffs.clone(),
            decisions=s.decisions.clone(),
            junior_draws=s.junior_draws.clone(),
            texts=texts,
        )
