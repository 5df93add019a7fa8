"""The per-token tandem logic every engine shares: sample, draw an author at boundaries, record.

Engines differ only in how they produce the two models' next-token logits (a Hugging Face loop
with dynamic caches, static caches replayed as a CUDA graph, ...). Everything that decides which
token is appended and who wrote it lives here, as pure tensor ops on preallocated buffers, so the
same seed gives the same rollout in every engine and the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from tandem_lit.rollout.handoff import HandoffPolicy, TokenClasses
from tandem_lit.rollout.record import Author, PausedSequence, PromptBatch, Rollout
from tandem_lit.rollout.sampling import SamplingConfig, sample_tokens, uniform
from tandem_lit.rollout.switch import set_log_mass, switch_codes

# RNG streams: independent uniforms per (sequence, the sequence's own step)
_CANDIDATE, _HANDOFF, _SWITCH, _FIRST_AUTHOR = 0, 1, 2, 3


@dataclass
class DecodeState:
    """Per-sequence decoding state, all [B] tensors on the decoding device."""

    author: Tensor  # long, author of the current span (SENIOR / JUNIOR)
    span_len: Tensor  # long, tokens written in the current span
    carry: Tensor  # long, the boundary rule's state (e.g. trailing line breaks)
    finished: Tensor  # bool, the sequence stopped (end-of-sequence token, or the span limit)
    ended: Tensor  # bool, it stopped with an end-of-sequence token (else it is truncated)
    spans: Tensor  # long, spans started so far
    handoffs: Tensor  # long, author switches
    decisions: Tensor  # long, author draws
    junior_draws: Tensor  # long, draws that picked the junior

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


class TandemDecoder:
    """Chooses and records one token per sequence per step, given both models' logits.

    Everything is per row: each row holds one sequence with its own seed, token budget and step
    counter ``t`` (its RNG draws are keyed by (seed, t)), so a sequence's tokens depend on its
    seed alone, never on its row, its neighbours or when it was admitted. That is what lets a
    continuous-batching engine ``admit`` new sequences into rows freed mid-batch.

    All buffers are allocated once and updated in place, so a CUDA graph that captured ``step``
    keeps reading and writing the same memory on every replay; ``narrow`` views the first rows
    (a smaller captured batch after compaction) over the same storage.
    """

    def __init__(
        self,
        policy: HandoffPolicy,
        classes: TokenClasses,
        sampling: SamplingConfig,
        batch_size: int,
        eos_token_ids: list[int],
        pad_token_id: int,
        fused_sampling: bool = False,
    ):
        device = classes.starts_ws.device
        self.policy = policy
        self.rule = policy.compile(classes)
        self.vocab_size = classes.vocab_size
        self.sampling = sampling
        # the Triton sampler draws by the same inverse CDF in one pass over the logits (GPU
        # engines with Triton kernels); top-k/top-p keep the torch path
        self.fused_sampling = fused_sampling and sampling.top_k == 0 and sampling.top_p == 1.0
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
        self.pad_token_id = pad_token_id
        self.only_author = policy.only_author
        self.batch_size = batch_size
        self.logprob_temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        # the token sets a switch's log-probs are taken over (``rollout.switch``); None: no switch
        # restricts a draw (solo policies, a draw before every token)
        self.token_sets = self.rule.token_sets() if self.only_author is None else None

        def zeros(dtype=torch.long) -> Tensor:
            return torch.zeros(batch_size, dtype=dtype, device=device)

        self.seeds, self.budget, self.t = zeros(), zeros(), zeros()  # t: tokens this row's sequence wrote
        # one scratch column past the longest budget: a stopped row keeps writing padding there
        width = sampling.max_new_tokens + 1
        self.tokens = torch.full((batch_size, width), pad_token_id, dtype=torch.long, device=device)
        self.authors = torch.zeros((batch_size, width), dtype=torch.int8, device=device)
        self.logprobs = torch.zeros((batch_size, width), dtype=torch.float32, device=device)
        # per token: the set it was drawn from, and the set of the senior's discarded candidate
        # where its span ended there (1-based rows of ``token_sets``; 0: none)
        self.start_sets = torch.zeros((batch_size, width), dtype=torch.int8, device=device)
        self.end_sets = torch.zeros((batch_size, width), dtype=torch.int8, device=device)
        self.state = DecodeState(
            author=zeros(), span_len=zeros(), carry=zeros(), finished=zeros(torch.bool), ended=zeros(torch.bool),
            spans=zeros(), handoffs=zeros(), decisions=zeros(), junior_draws=zeros(),
        )
        self.state.finished.fill_(True)  # a row without a sequence is a finished one

    def per_row(self) -> list[Tensor]:
        """Every per-row buffer (dim 0 = row): what moves with a sequence when rows are compacted."""
        return [self.seeds, self.budget, self.t, self.tokens, self.authors, self.logprobs, self.start_sets, self.end_sets,
                *self.state.tensors()]

    def narrow(self, rows: int) -> TandemDecoder:
        """This decoder over its first ``rows`` rows only (views: same storage, same state)."""
        view = copy.copy(self)
        view.batch_size = rows
        for name in ("seeds", "budget", "t", "tokens", "authors", "logprobs", "start_sets", "end_sets"):
            setattr(view, name, getattr(self, name)[:rows])
        view.state = DecodeState(*(x[:rows] for x in self.state.tensors()))
        return view

    def reset(self, seeds: Tensor, budgets: Tensor | None = None) -> None:
        """Start a new batch with these per-sequence seeds and token budgets, one per row."""
        rows = torch.arange(self.batch_size, device=self.seeds.device)
        if budgets is None:
            budgets = torch.full_like(rows, self.sampling.max_new_tokens)
        self.admit(rows, seeds, budgets)

    def admit(self, rows: Tensor, seeds: Tensor, budgets: Tensor) -> None:
        """Start new sequences in ``rows`` (draws each first span's author). Every per-row buffer of
        those rows is overwritten: nothing of a row's previous sequence survives."""
        s = self.state
        self.seeds.index_copy_(0, rows, seeds.to(self.seeds.device))
        self.budget.index_copy_(0, rows, budgets.to(self.budget.device))
        for buffer in (self.t, s.span_len, s.carry, s.finished, s.ended, s.handoffs):
            buffer.index_fill_(0, rows, 0)
        self.tokens.index_fill_(0, rows, self.pad_token_id)
        self.authors.index_fill_(0, rows, 0)
        self.logprobs.index_fill_(0, rows, 0.0)
        self.start_sets.index_fill_(0, rows, 0)
        self.end_sets.index_fill_(0, rows, 0)
        s.spans.index_fill_(0, rows, 1)
        if self.policy.first_author == "draw":
            junior = uniform(self.seeds[rows], 0, _FIRST_AUTHOR) < self.policy.p
            s.author.index_copy_(0, rows, torch.where(junior, int(Author.JUNIOR), int(Author.SENIOR)))
            s.decisions.index_fill_(0, rows, 1)
            s.junior_draws.index_copy_(0, rows, junior.long())
        else:
            s.author.index_fill_(0, rows, int(Author.JUNIOR if self.policy.first_author == "junior" else Author.SENIOR))
            s.decisions.index_fill_(0, rows, 0)
            s.junior_draws.index_fill_(0, rows, 0)

    def save(self, rows: Tensor) -> list[Tensor]:
        """Copies of ``rows``' per-row buffers (``per_row`` order): all of a sequence's decoding
        state, to ``restore`` in another row later (a preempted sequence that resumes)."""
        return [buffer[rows].clone() for buffer in self.per_row()]

    def restore(self, rows: Tensor, saved: list[Tensor]) -> None:
        """Put ``save``d sequences into ``rows``: they go on exactly where they stopped (their
        step counters, so their RNG draws, included)."""
        for buffer, values in zip(self.per_row(), saved):
            buffer.index_copy_(0, rows, values.to(buffer.device))

    def pause(self, rows: Tensor) -> list[PausedSequence]:
        """The sequences of ``rows`` as ``PausedSequence``s (host copies): what they wrote and their
        whole decoding state, to go on with in a later ``generate`` (``resume``)."""
        saved = [x.cpu() for x in self.save(rows)]
        written = self.t[rows].tolist()
        return [PausedSequence(n, saved[3][i, :n].clone(), saved[4][i, :n].clone(), [x[i] for x in saved])
                for i, n in enumerate(written)]

    def resume(self, rows: Tensor, paused: list[PausedSequence]) -> None:
        """Put paused sequences (``pause``, possibly of another decoder of the same policy) into
        ``rows``: they go on where they stopped."""
        self.restore(rows, [torch.stack(parts) for parts in zip(*(self.fit_state(p.state) for p in paused))])

    def fit_state(self, state: list[Tensor]) -> list[Tensor]:
        """A paused sequence's saved rows (``per_row`` order) at this decoder's width: a decoder of a
        larger ``max_new_tokens`` takes them padded (its budget stays the one it was drawn with)."""
        width = self.tokens.shape[1]
        if state[3].shape[-1] > width:
            raise ValueError(f"a paused sequence of up to {state[3].shape[-1] - 1} tokens cannot resume under "
                             f"sampling.max_new_tokens={width - 1}")
        fitted = []
        for i, (buffer, saved) in enumerate(zip(self.per_row(), state)):
            if buffer.dim() > 1 and saved.shape[-1] < width:
                saved = torch.nn.functional.pad(saved, (0, width - saved.shape[-1]), value=self.pad_token_id if i == 3 else 0)
            fitted.append(saved)
        return fitted

    def vacate(self) -> None:
        """Mark every row empty (finished), before sequences are admitted into some of them."""
        self.state.finished.fill_(True)
        self.state.ended.fill_(False)

    @property
    def needs_senior(self) -> bool:
        return self.only_author != Author.JUNIOR

    @property
    def needs_junior(self) -> bool:
        return self.only_author != Author.SENIOR

    def _draw(self, author: Tensor, senior: Tensor | None, junior: Tensor | None, u: Tensor,
              allowed: Tensor | None = None) -> Tensor:
        """A token per row from the logits of that row's ``author``."""
        if self.fused_sampling:
            from tandem_lit.rollout.static import kernels

            if senior is None or junior is None:
                return kernels.sample_rows(senior if junior is None else junior, u, self.sampling.temperature, allowed=allowed)
            return kernels.sample_rows(senior, u, self.sampling.temperature, junior, author == Author.JUNIOR, allowed)
        if junior is None:
            logits = senior
        elif senior is None:
            logits = junior
        else:
            logits = torch.where((author == Author.JUNIOR).unsqueeze(-1), junior, senior)
        return sample_tokens(logits, u, self.sampling, allowed)

    def _senior_logprob(self, senior: Tensor, token: Tensor, start: Tensor | None,
                        end: Tensor | None) -> tuple[Tensor, Tensor | None]:  # [B, V], [B] x 3 -> [B], [B]
        """The senior's log-prob of ``token`` under the set it was drawn from (``start`` codes),
        and the log-mass of each row's ``end`` set (the senior's span ending here; ``rollout.switch``)."""
        t = self.logprob_temperature
        if self.fused_sampling:
            from tandem_lit.rollout.static import kernels

            return kernels.token_logprobs(senior, token, t, self.token_sets, start, end)
        logp = (senior.float() / t).log_softmax(-1)
        chosen = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        if start is None:
            return chosen, None
        return chosen - set_log_mass(logp, self.token_sets, start), set_log_mass(logp, self.token_sets, end)

    def step(self, senior_logits: Tensor | None, junior_logits: Tensor | None) -> Tensor:
        """Append the next token of every live sequence and return it.  # logits [B, V'] -> [B] long

        Pure tensor ops on the row buffers (no host sync), so the step can be replayed from a CUDA
        graph. A row that reaches its budget stops, truncated.
        """
        s = self.state
        v = self.vocab_size
        t = self.t
        senior = senior_logits[:, :v] if senior_logits is not None else None
        junior = junior_logits[:, :v] if junior_logits is not None else None
        candidate = self._draw(s.author, senior, junior, uniform(self.seeds, t, _CANDIDATE))
        start = end = None
        if self.only_author is None:
            token, start, end = self._handoff(t, candidate, senior, junior)
        else:
            token = candidate
            s.span_len.add_(1)
        live = ~s.finished
        token = torch.where(live, token, self.pad_token_id)
        code = torch.where(live, s.author, int(Author.PAD)).to(torch.int8)
        column = t.unsqueeze(1)  # a stopped row's t is at most its budget: the scratch column at worst
        self.tokens.scatter_(1, column, token.unsqueeze(1))
        self.authors.scatter_(1, column, code.unsqueeze(1))
        if start is not None:
            start, end = torch.where(live, start, 0), torch.where(live, end, 0)
            self.start_sets.scatter_(1, column, start.to(torch.int8).unsqueeze(1))
            self.end_sets.scatter_(1, column, end.to(torch.int8).unsqueeze(1))
        if senior is not None:
            logprob, end_mass = self._senior_logprob(senior, token, start, end)
            self.logprobs.scatter_(1, column, torch.where(live, logprob, 0.0).unsqueeze(1))
            if end_mass is not None:  # the senior's span ended here: scored on its last token, t - 1
                self.logprobs.scatter_add_(1, (t - 1).clamp_min(0).unsqueeze(1), torch.where(end > 0, end_mass, 0.0).unsqueeze(1))
        s.carry.copy_(self.rule.update(s.carry, token))
        if not self.sampling.ignore_eos:
            s.ended.logical_or_(token.unsqueeze(-1).eq(self.eos).any(-1) & live)
            s.finished.logical_or_(s.ended)
        t.add_(live.long())
        s.finished.logical_or_(t >= self.budget)  # the budget: stopped without an end token (truncated)
        return token

    def _handoff(self, t: Tensor, candidate: Tensor, senior: Tensor, junior: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The token of every row, with its switch codes (``rollout.switch``; None: no sets)."""
        s = self.state
        boundary = self.rule.at_boundary(s.carry, candidate) & (s.span_len > 0)
        allowed = self.rule.start_allowed(s.carry)
        forced = None
        if self.policy.max_span is not None:
            forced = s.span_len >= self.policy.max_span
            boundary = boundary | forced
            if allowed is not None:  # a forced draw may start mid-word: no constraint there
                allowed = allowed | forced.unsqueeze(-1)
        drawn = torch.where(uniform(self.seeds, t, _HANDOFF) < self.policy.p, int(Author.JUNIOR), int(Author.SENIOR))
        new_author = torch.where(boundary, drawn, s.author)
        switched = new_author != s.author
        switch_token = self._draw(new_author, senior, junior, uniform(self.seeds, t, _SWITCH), allowed)
        start = end = None
        if self.token_sets is not None:
            start, end = switch_codes(self.rule.states, self.rule.state(s.carry), switched, forced, s.author == Author.SENIOR)
        if self.policy.max_spans is not None:  # the span limit ends the rollout here, as truncated
            s.finished.logical_or_(boundary & (s.spans >= self.policy.max_spans))
        live = ~s.finished
        s.spans.add_((boundary & live).long())
        s.decisions.add_((boundary & live).long())
        s.junior_draws.add_((boundary & live & (drawn == Author.JUNIOR)).long())
        s.handoffs.add_((switched & live).long())
        s.span_len.copy_(torch.where(boundary, 1, s.span_len + 1))  # a draw starts a new span
        s.author.copy_(new_author)
        return torch.where(switched, switch_token, candidate), start, end

    def all_finished(self) -> bool:
        return bool(self.state.finished.all())

    def outputs(self) -> dict[str, Tensor]:
        """What a finished row contributes to the Rollout (views of the row buffers, dim 0 = row)."""
        s = self.state
        width = self.sampling.max_new_tokens
        return {
            "tokens": self.tokens[:, :width], "authors": self.authors[:, :width], "logprobs": self.logprobs[:, :width],
            "start_sets": self.start_sets[:, :width], "end_sets": self.end_sets[:, :width],
            "ended": s.ended, "handoffs": s.handoffs, "decisions": s.decisions, "junior_draws": s.junior_draws,
        }

    def finish(self, prompts: PromptBatch, tokenizer) -> Rollout:
        """Package the rows (one per prompt, in order) as a Rollout."""
        return package_rollout(prompts, {k: v.clone() for k, v in self.outputs().items()}, tokenizer, self.needs_senior,
                               self.token_sets)


def package_rollout(prompts: PromptBatch, out: dict[str, Tensor], tokenizer, has_logprobs: bool,
                    token_sets: Tensor | None = None) -> Rollout:
    """A Rollout from per-sequence ``TandemDecoder.outputs`` (trimmed to the longest completion);
    ``token_sets``: the decoder's, which its switch codes name."""
    lengths = (out["authors"] != Author.PAD).sum(-1)
    width = max(int(lengths.max().item()) if lengths.numel() else 0, 1)
    tokens = out["tokens"][:, :width]
    rows = tokens.cpu().tolist()
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(rows, lengths.tolist())], skip_special_tokens=True)
    return Rollout(
        prompt_ids=prompts.input_ids,
        prompt_mask=prompts.attention_mask,
        completion_ids=tokens,
        author=out["authors"][:, :width],
        finished=out["ended"],
        truncated=~out["ended"],
        handoffs=out["handoffs"],
        decisions=out["decisions"],
        junior_draws=out["junior_draws"],
        texts=texts,
        senior_logprobs=out["logprobs"][:, :width] if has_logprobs else None,
        start_set=out["start_sets"][:, :width].cpu() if token_sets is not None else None,
        end_set=out["end_sets"][:, :width].cpu() if token_sets is not None else None,
        token_sets=token_sets,
    )
