"""TextHandoffEngine: tandem rollouts when the senior and junior tokenize differently.

Token-level lockstep needs one vocabulary. Here each model keeps its own token stream: the
active author writes tokens in its own vocabulary; when a boundary (of the author's own
tokenizer) hands the pen over, the finished span is decoded to text, re-encoded with the other
model's tokenizer and prefilled into that model's cache, and the new author continues. Only the
active model runs per token; the other catches up once per handoff.

The Rollout is in the senior's tokens: its own spans as written, junior spans as re-encoded for
(and read by) the senior, each marked with its author, so the objective sees exactly the token
stream the senior was conditioned on. The token budget counts tokens written by either model.
Rows are decoded one at a time (ragged per-row re-encoding): correct, not fast.

The senior's log-probs are recorded for the tokens it wrote, with the switch terms of
``rollout.switch`` (its first token after the junior's span drawn from its own start set; its span
ending at its own boundary); junior tokens, drawn in the junior's vocabulary and re-encoded, hold 0
(the update's diagnostics and corrections read senior tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.decoder import _CANDIDATE, _FIRST_AUTHOR, _HANDOFF, _SWITCH
from tandem_lit.rollout.engine import RolloutEngine, cache_kwarg, check_max_batch, end_token_ids, eval_mode
from tandem_lit.rollout.handoff import BoundaryRule, HandoffPolicy, TokenClasses
from tandem_lit.rollout.record import Author, PromptBatch, Rollout
from tandem_lit.rollout.sampling import SamplingConfig, sample_tokens, uniform
from tandem_lit.rollout.switch import set_log_mass
from tandem_lit.rollout.weights import check_rollout_dtype


class _Writer:
    """One model's view of a single sequence: its own tokens, KV cache and boundary state."""

    def __init__(self, model: nn.Module, tokenizer, rule: BoundaryRule, eos: list[int], device):
        self.model, self.tokenizer, self.rule = model, tokenizer, rule
        self.eos = set(eos)
        self.device = device
        self.cache_kwarg = cache_kwarg(model)

    def start(self, prompt_ids: list[int]) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.length = 0
        self.carry = torch.zeros(1, dtype=torch.long, device=self.device)
        self.feed(prompt_ids, track=False)  # boundaries count from the completion, as in lockstep engines

    def feed(self, ids: list[int], track: bool = True) -> None:
        """Extend this model's context; ``logits`` then predicts the next token."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(self.length, self.length + len(ids), device=self.device).unsqueeze(0)
        out = self.model(input_ids=x, position_ids=positions, use_cache=True, logits_to_keep=1, **{self.cache_kwarg: self.cache})
        self.length += len(ids)
        for token in ids if track else ():
            self.carry = self.rule.update(self.carry, torch.tensor([token], device=self.device))
        self.logits = out.logits[:, -1, : self.rule.classes.vocab_size].float()

    def sample(self, seed: Tensor, step: int, stream: int, sampling: SamplingConfig, allowed: Tensor | None = None) -> int:
        return int(sample_tokens(self.logits, uniform(seed, step, stream), sampling, allowed))

    def set_log_mass(self, temperature: float, sets: Tensor, code: int) -> float:
        """log of this model's next-token mass on set ``code`` (``rollout.switch``), at the temperature."""
        logp = (self.logits / temperature).log_softmax(-1)
        return float(set_log_mass(logp, sets, torch.tensor([code], device=logp.device)))

    def logprob(self, temperature: float, token: int) -> float:
        return float((self.logits / temperature).log_softmax(-1)[0, token])

    def decode_span(self, ids: list[int], before: int | None) -> str:
        """The text ``ids`` add after token ``before`` (decoded with it, so leading spaces survive)."""
        if before is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        anchor = self.tokenizer.decode([before], skip_special_tokens=True)
        full = self.tokenizer.decode([before, *ids], skip_special_tokens=True)
        return full[len(anchor):] if full.startswith(anchor) else full

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


@dataclass
class _Row:
    """The finished record of one sequence, in the senior's tokens."""

    ids: list[int] = field(default_factory=list)
    authors: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the senior's, at its own tokens (0 at the junior's)
    start_set: list[int] = field(default_factory=list)  # switch codes (``rollout.switch``)
    end_set: list[int] = field(default_factory=list)
    ends: list[tuple[int, int, float]] = field(default_factory=list)  # (position, end code, its log-mass)
    ended: bool = False
    handoffs: int = 0
    decisions: int = 0
    junior_draws: int = 0


class TextHandoffEngine(RolloutEngine):
    """Tandem rollouts between models with different tokenizers (text-level handoff).

    Needs ``partner`` prompts (the prompts encoded for the junior) in each PromptBatch; the
    TandemModule builds them with the junior's own tokenizer and chat template.

    Args:
        rollout_dtype: Dtype of the senior's rollout copy (see ``RolloutEngine``).
    """

    needs_partner_prompts = True

    def __init__(self, rollout_dtype: str = "auto"):
        self.rollout_dtype = check_rollout_dtype(rollout_dtype)

    def setup(self, senior: nn.Module, junior: nn.Module | None, tokenizer, junior_tokenizer=None,
              max_batch: int | None = None) -> None:
        self.max_batch = check_max_batch(max_batch)
        self.bind_senior(senior)
        self.junior = junior
        self.tokenizer = tokenizer
        self.junior_tokenizer = junior_tokenizer or tokenizer
        self.eos_token_ids = end_token_ids(tokenizer, senior)
        self.junior_eos = end_token_ids(self.junior_tokenizer, junior) if junior is not None else []
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self._classes: dict[tuple[int, str], TokenClasses] = {}

    def _token_classes(self, tokenizer, device) -> TokenClasses:
        key = (id(tokenizer), str(device))
        if key not in self._classes:
            self._classes[key] = TokenClasses.from_tokenizer(tokenizer, device)
        return self._classes[key]

    def generate(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig) -> Rollout:
        self.check_models(policy)
        if prompts.partner is None:
            raise ConfigError("TextHandoffEngine needs the prompts encoded for the junior (PromptBatch.partner)")
        device = next(self.senior.parameters()).device
        senior_classes = self._token_classes(self.tokenizer, device)
        junior_classes = self._token_classes(self.junior_tokenizer, device)
        writers = {
            Author.SENIOR: _Writer(self.senior, self.tokenizer, policy.compile(senior_classes), self.eos_token_ids, device),
            Author.JUNIOR: _Writer(self.junior, self.junior_tokenizer, policy.compile(junior_classes), self.junior_eos, device),
        }
        budgets = prompts.budgets(sampling.max_new_tokens).tolist()
        sets = writers[Author.SENIOR].rule.token_sets() if policy.only_author is None else None
        rows = []
        with eval_mode(self.senior, self.junior):
            for b in range(prompts.batch_size):
                prompt_views = {
                    Author.SENIOR: _unpadded(prompts.input_ids[b], prompts.attention_mask[b]),
                    Author.JUNIOR: _unpadded(prompts.partner.input_ids[b], prompts.partner.attention_mask[b]),
                }
                rows.append(self._one(writers, prompt_views, prompts.seeds[b : b + 1].to(device), policy, sampling,
                                     budgets[b], sets))
        return self._rollout(prompts, rows, sets, policy.only_author != Author.JUNIOR)

    def _one(self, writers: dict, prompt_views: dict, seed: Tensor, policy: HandoffPolicy, sampling: SamplingConfig,
             budget: int, sets: Tensor | None) -> _Row:
        row = _Row()
        temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        senior = writers[Author.SENIOR]
        rule = senior.rule
        for author, writer in writers.items():
            writer.start(prompt_views[author])
        if policy.first_author == "draw":
            junior = bool(uniform(seed, 0, _FIRST_AUTHOR) < policy.p)
            author, row.decisions, row.junior_draws = (Author.JUNIOR if junior else Author.SENIOR), 1, int(junior)
        else:
            author = Author.JUNIOR if policy.first_author == "junior" else Author.SENIOR
        span: list[int] = []  # tokens of the current span, in the active writer's vocabulary
        scores: list[tuple[float, int]] = []  # the senior's (log-prob, start code) of each of its span's tokens
        before: int | None = None  # the token before the span, in that vocabulary
        spans = 1
        for t in range(budget):
            writer = writers[author]
            token = writer.sample(seed, t, _CANDIDATE, sampling)
            start = 0
            boundary = bool(span) and bool(writer.rule.at_boundary(writer.carry, torch.tensor([token], device=writer.device)))
            forced = policy.max_span is not None and len(span) >= policy.max_span
            if (boundary or forced) and policy.only_author is None:
                if policy.max_spans is not None and spans >= policy.max_spans:
                    break  # the span limit: truncated
                spans += 1
                drawn = Author.JUNIOR if bool(uniform(seed, t, _HANDOFF) < policy.p) else Author.SENIOR
                row.decisions += 1
                row.junior_draws += int(drawn == Author.JUNIOR)
                if drawn != author:  # hand the text over: the other model reads the span, then writes
                    text = writer.decode_span(span, before)
                    self._record(row, author, text, span, scores)
                    coded = sets is not None and not forced
                    if author == Author.SENIOR and coded:  # its span ended: scored on its last token
                        code = 1 + rule.states + int(rule.state(senior.carry))
                        row.ends.append((len(row.ids), code, senior.set_log_mass(temperature, sets, code)))
                    writer, author, span, scores = writers[drawn], drawn, [], []
                    fed = writer.encode(text)
                    if fed:
                        writer.feed(fed)
                    before = fed[-1] if fed else None
                    allowed = None if forced else writer.rule.start_allowed(writer.carry)
                    token = writer.sample(seed, t, _SWITCH, sampling, allowed)
                    if author == Author.SENIOR and coded:
                        start = 1 + int(rule.state(senior.carry))
                    row.handoffs += 1
            if author == Author.SENIOR:  # the distribution the token was drawn from (rollout.switch)
                mass = senior.set_log_mass(temperature, sets, start) if start else 0.0
                scores.append((senior.logprob(temperature, token) - mass, start))
            span.append(token)
            if token in writer.eos and not sampling.ignore_eos:
                row.ended = True
                break
            writer.feed([token])
        self._record(row, author, writers[author].decode_span(span, before), span, scores)
        for position, code, mass in row.ends:  # (a junior span that re-encoded to nothing at the end: no token)
            if position < len(row.ids):
                row.end_set[position] = code
                row.logprobs[position - 1] += mass
        return row

    def _record(self, row: _Row, author: Author, text: str, span: list[int], scores: list[tuple[float, int]]) -> None:
        """Append a finished span to the row in senior tokens (a junior end token becomes the senior's)."""
        if author == Author.SENIOR:
            ids = list(span)
            row.logprobs.extend(logprob for logprob, _ in scores)
            row.start_set.extend(code for _, code in scores)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if span and span[-1] in self.junior_eos and row.ended:
                ids.append(self.eos_token_ids[0])
            row.logprobs.extend([0.0] * len(ids))
            row.start_set.extend([0] * len(ids))
        row.ids.extend(ids)
        row.authors.extend([int(author)] * len(ids))
        row.end_set.extend([0] * len(ids))

    def _rollout(self, prompts: PromptBatch, rows: list[_Row], sets: Tensor | None, senior_wrote: bool) -> Rollout:
        width = max(1, max(len(r.ids) for r in rows))
        batch = len(rows)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        authors, starts, ends = (torch.zeros((batch, width), dtype=torch.int8) for _ in range(3))
        logprobs = torch.zeros((batch, width), dtype=torch.float32)
        for i, r in enumerate(rows):
            n = len(r.ids)
            ids[i, :n] = torch.tensor(r.ids, dtype=torch.long)
            authors[i, :n] = torch.tensor(r.authors, dtype=torch.int8)
            logprobs[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
            starts[i, :n] = torch.tensor(r.start_set, dtype=torch.int8)
            ends[i, :n] = torch.tensor(r.end_set, dtype=torch.int8)
        device = prompts.input_ids.device
        ended = torch.tensor([r.ended for r in rows])
        return Rollout(
            prompt_ids=prompts.input_ids,
            prompt_mask=prompts.attention_mask,
            completion_ids=ids.to(device),
            author=authors.to(device),
            finished=ended.to(device),
            truncated=(~ended).to(device),
            handoffs=torch.tensor([r.handoffs for r in rows], device=device),
            decisions=torch.tensor([r.decisions for r in rows], device=device),
            junior_draws=torch.tensor([r.junior_draws for r in rows], device=device),
            texts=self.tokenizer.batch_decode([r.ids for r in rows], skip_special_tokens=True),
            senior_logprobs=logprobs.to(device) if senior_wrote else None,
            start_set=starts if sets is not None else None,
            end_set=ends if sets is not None else None,
            token_sets=sets.to(device) if sets is not None else None,
        )


def _unpadded(ids: Tensor, mask: Tensor) -> list[int]:
    return ids[mask.bool()].tolist()
