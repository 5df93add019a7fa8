"""The evaluation half of TandemModule: validation, ``tandem-lit test`` and ``predict``.

Every mode is a rollout through the same engine and verifier as training (one grader for rewards
and correctness), with the evaluation's own handoff and sampling:

- validation (``eval_modes``: senior alone, junior alone, tandem) logs ``eval/<mode>_<metric>``
  at the number of optimiser updates so far, once before training if asked;
- test reports solo and handoff pass@k per eval set and their macro average, plus the partner's
  cross-entropy on the model's solo text (legibility), to ``eval/results.{json,md}``, rewritten as
  each set finishes; a re-run of the same settings continues after the finished sets
  (``test_progress``);
- predict writes graded completions of every mode, spans marked by author.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Literal

import torch

from tandem_lit.evaluation.forced_token import forced_token_outcomes
from tandem_lit.evaluation.metrics import pass_at_k
from tandem_lit.evaluation.report import (
    DatasetTally,
    flat_metrics,
    markdown_table,
    merge_totals,
    summarize,
    write_report,
)
from tandem_lit.evaluation.test_progress import EvalProgress, FinishedSets, checkpoint_identity
from tandem_lit.rollout import out_of_memory
from tandem_lit.rollout.handoff import HandoffPolicy, SoloHandoff
from tandem_lit.rollout.logprobs import completion_logprobs
from tandem_lit.rollout.record import Author, Rollout
from tandem_lit.rollout.result import RolloutResult
from tandem_lit.verifiers.base import label_means

log = logging.getLogger(__name__)

EvalMode = Literal["senior", "junior", "tandem"]


class EvaluationSteps:
    """Lightning's validation, test and predict hooks of ``TandemModule`` (a mixin: it uses the
    module's ``rollouts`` phase, ``evaluation`` and ``logging_settings``, ``jargon`` and loggers)."""

    def eval_policy(self, mode: EvalMode) -> HandoffPolicy:
        if mode == "tandem":
            return self.evaluation.handoff
        return SoloHandoff(author=mode)

    def evaluate_batch(self, rows: list[dict[str, Any]], key: int, row_ids: list[int] | None = None) -> dict[str, tuple[float, int]]:
        """Each eval mode on one batch: {metric name: (mean, count)}. ``row_ids``: the rows'
        places in the whole batch (their seeds), when this is one rank's share of it."""
        out: dict[str, tuple[float, int]] = {}
        for mode in self.evaluation.modes:
            result = self.rollouts.generate(rows, self.eval_policy(mode), self.evaluation.sampling, key, row_ids)
            n = len(result.grades)
            out[f"eval/{mode}_accuracy"] = (sum(result.correct) / n, n)
            samples = self.evaluation.sampling.n
            correct = torch.tensor(result.correct).view(len(rows), samples).sum(-1).tolist()
            for k in self.evaluation.pass_k:
                if 1 < k <= samples:
                    out[f"eval/{mode}_pass_at_{k}"] = (sum(pass_at_k(samples, c, k) for c in correct) / len(rows), len(rows))
            out[f"eval/{mode}_jargon_rate"] = (self.jargon.rate(result.rollout.texts), n)
            if self.logging_settings.language is not None:
                shares = [s for s in self.logging_settings.language.shares(result.rollout.texts) if s is not None]
                if shares:  # (texts with no identifiable language, e.g. bare equations, do not count)
                    out[f"eval/{mode}_language_share"] = (sum(shares) / len(shares), len(shares))
            for name, measured in label_means(result.grades).items():  # the verifier's own (elegance, tests passed)
                out[f"eval/{mode}_{name}"] = measured
            out[f"eval/{mode}_response_length"] = (float(result.rollout.lengths.float().mean()), n)
            out[f"eval/{mode}_truncation_rate"] = (float(result.rollout.truncated.float().mean()), n)
            if mode == "tandem":
                out["eval/tandem_junior_token_share"] = (result.rollout.junior_token_share(), n)
                self.write_completions(result, "eval_tandem")
        return out

    def evaluate_share(self, rows: list[dict[str, Any]], key: int, totals: dict[str, list[float]]) -> None:
        """Add this process's share of an eval batch (all of it in one process; every W-th row of
        it on each of W ranks) to ``totals``: {metric name: [sum, count]}."""
        world, rank = self.trainer.world_size, self.trainer.global_rank
        ids = list(range(rank, len(rows), world))
        if not ids:
            return
        share = rows if world == 1 else [rows[i] for i in ids]
        with out_of_memory.phase("evaluation", self.device, self.trainer):
            measured = self.evaluate_batch(share, key, None if world == 1 else ids)
        for name, (value, count) in measured.items():
            total = totals.setdefault(name, [0.0, 0])
            total[0] += value * count
            total[1] += count

    def eval_means(self, totals: dict[str, list[float]]) -> dict[str, float]:
        """Means over every rank's share."""
        if self.trainer.world_size > 1:
            totals = merge_totals(totals)
        return {name: s / max(c, 1) for name, (s, c) in sorted(totals.items())}

    def on_validation_epoch_start(self) -> None:
        self._eval_totals: dict[str, list[float]] = {}
        self.rollouts.ready()  # every rank at once: with FSDP, filling the rollout copy is a collective

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        self.evaluate_share(batch, batch_idx, self._eval_totals)

    def on_validation_epoch_end(self) -> None:
        means = self.eval_means(self._eval_totals)
        for name, value in means.items():  # for callbacks (checkpoint monitor, progress bar)
            # (equal on every rank already: sync_dist only keeps Lightning from advising it)
            self.log(name, value, logger=False, prog_bar=name.endswith("senior_accuracy"), sync_dist=True)
        if not self.trainer.sanity_checking:
            self.log_metrics_at_update(means)

    def on_train_start(self) -> None:
        if not self.evaluation.at_start or self.global_step > 0 or not self.trainer.val_dataloaders:
            return
        self.rollouts.ready()
        totals: dict[str, list[float]] = {}
        # the batches a validation runs (trainer.limit_val_batches), so the first point of each eval
        # curve is measured on the same problems as the others
        limit = self.trainer.num_val_batches[0] if self.trainer.num_val_batches else float("inf")
        for index, rows in enumerate(self.trainer.val_dataloaders):
            if index >= limit:
                break
            self.evaluate_share(rows, index, totals)
        row = self.eval_means(totals)
        self.log_metrics_at_update(row)
        log.info("evaluation before training: %s", json.dumps({k: round(v, 4) for k, v in row.items()}))

    def predict_step(self, batch: list[dict[str, Any]], batch_idx: int, dataloader_idx: int = 0) -> list[dict[str, Any]]:
        """Completions of every eval mode for the rows (``eval_sampling``), graded, with spans
        marked by author; also appended to ``predictions.jsonl`` in the run folder."""
        records = []
        for mode in self.evaluation.modes:
            result = self.rollouts.generate(batch, self.eval_policy(mode), self.evaluation.sampling, dataloader_idx * 1_000_003 + batch_idx)
            for i, grade in enumerate(result.grades):
                spans = result.rollout.spans(i, self.tokenizer)
                records.append({
                    "mode": mode,
                    "prompt": batch[i // self.evaluation.sampling.n]["prompt"],
                    "completion": result.rollout.texts[i],
                    "reward": grade.reward,
                    "correct": grade.correct,
                    "extracted": grade.extracted,
                    "spans": [{"author": a.name.lower(), "text": t} for a, t in spans],
                })
        if self.trainer.is_global_zero:
            path = Path(self.trainer.default_root_dir) / "predictions.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        return records

    def test_step(self, batch: list[dict[str, Any]], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Solo and handoff samples of every problem, graded, tallied per eval set (a set an
        earlier run of these settings finished is kept, not measured again)."""
        name = str(batch[0].get("dataset", f"set{dataloader_idx}"))
        if name in getattr(self, "_kept_sets", ()):
            self.test_progress.done += len(batch) * self.test_rollouts_per_problem()
            return
        with out_of_memory.phase("evaluation", self.device, self.trainer):
            self.test_batch(batch, name, dataloader_idx * 1_000_003 + batch_idx)
        self.test_progress.done += len(batch) * self.test_rollouts_per_problem()
        self.test_progress.measured += len(batch) * self.test_rollouts_per_problem()

    def test_rollouts_per_problem(self) -> int:
        return self.evaluation.test_sampling.n * (2 if self.junior is not None else 1)

    def test_batch(self, batch: list[dict[str, Any]], name: str, key: int) -> None:
        tally = self._test_tallies.setdefault(name, DatasetTally(n=self.evaluation.test_sampling.n))
        solo = self.rollouts.generate(batch, SoloHandoff("senior"), self.evaluation.test_sampling, key)
        self._tally(tally, solo, handoff=False)
        if self.evaluation.test_forced_token:
            tally.forced.extend((o.solo_correct, o.correct, o.position is not None) for o in forced_token_outcomes(self, batch, solo, key))
        if self.junior is not None:
            handoff = self.rollouts.generate(batch, self.evaluation.test_handoff, self.evaluation.test_sampling, key)
            self._tally(tally, handoff, handoff=True)
            prompts = [row["prompt"] for row in batch for _ in range(self.evaluation.test_sampling.n)]
            nll, tokens, chars = self.partner_cross_entropy(solo.rollout, prompts)
            tally.partner_nll += nll
            tally.partner_tokens += tokens
            tally.partner_chars += chars

    def _tally(self, tally: DatasetTally, result: RolloutResult, handoff: bool) -> None:
        n = self.evaluation.test_sampling.n
        per_problem = torch.tensor(result.correct).view(-1, n).sum(-1).tolist()
        (tally.handoff_correct if handoff else tally.solo_correct).extend(per_problem)
        (tally.handoff_lengths if handoff else tally.solo_lengths).extend(result.rollout.lengths.tolist())
        (tally.handoff_truncated if handoff else tally.solo_truncated).extend(result.rollout.truncated.tolist())
        labels = tally.handoff_labels if handoff else tally.solo_labels
        for name, (mean, count) in label_means(result.grades).items():
            total = labels.setdefault(name, [0.0, 0])
            total[0] += mean * count
            total[1] += count

    @torch.no_grad()
    def partner_cross_entropy(self, rollout: Rollout, prompts: list[str]) -> tuple[float, int, int]:
        """Legibility: the partner's summed negative log-likelihood of the model's solo text
        (temperature 1, teacher-forced), the partner tokens it covers, and the characters of that
        text. A partner with a tokenizer of its own reads the text in its own tokens (and the
        prompts, one per row, in its own chat template): the per-token figure is per *partner*
        token, and the per-character one compares pairs whose tokenizers differ."""
        rollout = self.partner_view(rollout, prompts)
        rows = torch.arange(rollout.completion_ids.shape[0], device=self.device)
        total, tokens = 0.0, 0
        for m in rows.split(self.update_settings.micro_batch_size):
            part = rollout.select(m)
            logp = completion_logprobs(self.junior, part, temperature=1.0)
            mask = part.completion_mask
            total += float(-(logp * mask).sum())
            tokens += int(mask.sum())
        return total, tokens, sum(len(text) for text in rollout.texts)

    def partner_has_own_tokenizer(self) -> bool:
        partner = self.junior_tokenizer
        return partner is not None and partner is not self.tokenizer and partner.get_vocab() != self.tokenizer.get_vocab()

    def partner_view(self, rollout: Rollout, prompts: list[str]) -> Rollout:
        """The senior's solutions as the partner reads them: after its own prompts (its prompt
        format), in its own tokens when it has a tokenizer of its own."""
        if self.partner_has_own_tokenizer():
            return self.partner_tokens(rollout, prompts)
        if self.rollout_settings.junior_prompt_format is None:
            return rollout
        encoded = self.rollouts.encode_junior_prompts(prompts)
        return dataclasses.replace(
            rollout, prompt_ids=encoded["input_ids"].to(self.device), prompt_mask=encoded["attention_mask"].to(self.device)
        )

    def partner_tokens(self, rollout: Rollout, prompts: list[str]) -> Rollout:
        """The same solutions as the partner reads them: its prompts, the text in its tokens, and
        its end token where the solution ended."""
        tokenizer = self.junior_tokenizer
        encoded = self.rollouts.encode_junior_prompts(prompts)
        end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = [
            tokenizer(text, add_special_tokens=False)["input_ids"] + (end if finished else [])
            for text, finished in zip(rollout.texts, rollout.finished.tolist())
        ]
        width = max(1, max(len(row) for row in ids))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        device = self.device
        completion = torch.tensor([row + [pad] * (width - len(row)) for row in ids], device=device)
        author = torch.tensor(
            [[int(Author.SENIOR)] * len(row) + [int(Author.PAD)] * (width - len(row)) for row in ids],
            dtype=torch.int8, device=device,
        )
        zeros = torch.zeros(len(ids), dtype=torch.long, device=device)
        return Rollout(
            encoded["input_ids"].to(device), encoded["attention_mask"].to(device), completion, author,
            rollout.finished.to(device), rollout.truncated.to(device), zeros, zeros, zeros, texts=list(rollout.texts),
        )

    def test_settings(self) -> dict[str, Any]:
        """What the numbers of a test depend on (written with them, and compared by a re-run)."""
        return {
            "sampling": vars(self.evaluation.test_sampling), "handoff": repr(self.evaluation.test_handoff), "pass_k": self.evaluation.pass_k,
            "senior": vars(self.senior_source), "partner": vars(self.junior_source) if self.junior_source else None,
        }

    def on_test_epoch_start(self) -> None:
        self._test_tallies = {}
        settings = dict(self.test_settings(), checkpoint=checkpoint_identity(getattr(self.trainer, "ckpt_path", None)),
                        forced_token=self.evaluation.test_forced_token)
        self._finished = FinishedSets(Path(self.trainer.default_root_dir) / "eval", settings)
        loaders = self.trainer.test_dataloaders or []
        loaders = loaders if isinstance(loaders, list) else [loaders]
        sizes = {}  # eval set name -> problems this run would measure
        for loader in loaders:
            rows = [row for batch in loader for row in batch]
            if rows:
                sizes[str(rows[0].get("dataset", ""))] = len(rows)
        earlier = self._finished.load() if self.trainer.world_size == 1 else {}
        self._kept_sets = {name for name, tally in earlier.items() if sizes.get(name) == len(tally.solo_correct)}
        for name in self._kept_sets:
            self._test_tallies[name] = earlier[name]
            log.info("eval set %s: kept from an earlier run of these settings (eval/tallies.json)", name)
        self.test_progress = EvalProgress(total=sum(sizes.values()) * self.test_rollouts_per_problem())

    def on_test_batch_end(self, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        """When a set's last batch is done: its tally kept, the report of the sets done so far written."""
        name = str(batch[0].get("dataset", f"set{dataloader_idx}"))
        batches = self.trainer.num_test_batches
        last = batch_idx + 1 >= (batches[dataloader_idx] if isinstance(batches, list) else batches)
        if not last or name in self._kept_sets or name not in self._test_tallies or not self.trainer.is_global_zero:
            return
        if self.trainer.world_size == 1:  # (several processes hold a share each: the report at the end)
            self._finished.add(name, self._test_tallies[name])
            self.write_test_report(print_table=False)
        log.info("eval set %s finished (%s); eval/results.json updated", name, self.test_progress.line())

    def on_test_epoch_end(self) -> None:
        self.test_report = self.write_test_report(print_table=True)
        self.log_dict(flat_metrics(self.test_report))

    def write_test_report(self, print_table: bool) -> dict:
        report = summarize(self._test_tallies, self.evaluation.pass_k)
        report["settings"] = self.test_settings()
        if self.trainer.is_global_zero:
            from tandem_lit.runs import log_artifact

            for path in write_report(report, self.evaluation.pass_k, Path(self.trainer.default_root_dir) / "eval"):
                if print_table:  # (logged once, at the end)
                    log_artifact(self.trainer, path, "eval")
            if print_table:
                print(markdown_table(report, self.evaluation.pass_k))
        return report
