"""Rows for supervised fine-tuning (``SFTModel``): a ``prompt`` the model reads and a ``target``
it learns to write.

``SFTDataModule`` formats any rows (a local JSONL/JSON file or folder, or a hub dataset) with two
templates over the row's fields; ``GSM8KSolutionsDataModule`` is its GSM8K preset: the training
solutions, calculator annotations kept (Tandem Training's jargon senior) or stripped. The order is
``SeededBatches``' (seeded, reshuffled each epoch, resumed exactly from a checkpoint); validation
rows are a seeded slice held out of the training rows.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from tandem_lit.data.base import PromptDataModule, Split, held_out_split, require_fields
from tandem_lit.data.fields import template_fields, template_types
from tandem_lit.data.gsm8k import final_answer, load_table, table_name
from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers.columns import check_records

JARGON = r"<<[^<>\n]*>>"  # GSM8K's calculator annotations, <<48/2=24>> (TandemModule's jargon_pattern)


class SFTDataModule(PromptDataModule):
    """Rows of prompt and target text for ``SFTModel``, formatted from a dataset's fields.

    Each row becomes ``{"prompt": prompt_template.format(**row), "target":
    target_template.format(**row)}``; the prompt is formatted further (chat template) by the model
    exactly as ``TandemModule`` formats prompts, so write the prompt template the tandem run will
    use. A row without a field a template reads is an error naming the row and the field.

    Args:
        source: Local JSONL/JSON file (all of it is the training data), a folder with
            ``<split>.jsonl``, or a hub dataset name.
        prompt_template: Format string over the row's fields: the context (no loss on it).
        target_template: Format string over the row's fields: what the model learns to write (the
            end-of-sequence token is added). Begin it with a space if the prompt ends in ``:``.
        strip_pattern: Regex whose matches are removed from targets (e.g. ``<<[^<>\\n]*>>`` for
            GSM8K's calculator annotations); None keeps targets as they are.
        split: The split to read from a folder or a hub dataset.
        hub_config: The hub dataset's configuration name, if it has several.
        val_size: Rows held out of the training rows (seeded) for ``eval/loss``; 0: no validation.
        train_limit: Use only the first N training rows (after the held-out slice).
        batch_size: Sequences per training step.
        eval_batch_size: Sequences per validation batch (default: batch_size).
        seed: Seed of the training order and of the held-out slice.
    """

    def __init__(
        self,
        source: str,
        prompt_template: str = "{prompt}",
        target_template: str = "{target}",
        strip_pattern: str | None = None,
        split: str = "train",
        hub_config: str | None = None,
        val_size: int = 0,
        train_limit: int | None = None,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed)
        self.source = source
        self.prompt_template = prompt_template
        self.target_template = target_template
        self.fields = list(dict.fromkeys(
            template_fields(prompt_template, "prompt_template") + template_fields(target_template, "target_template")
        ))
        try:
            self.strip = re.compile(strip_pattern) if strip_pattern else None
        except re.error as err:
            raise ConfigError(f"strip_pattern {strip_pattern!r} is not a valid regex: {err}") from None
        self.split = split
        self.hub_config = hub_config
        self.val_size = val_size
        self.train_limit = train_limit

    def load_split(self, split: Split) -> list[dict[str, Any]]:
        if split == "test":
            raise DataError("SFT data has no test split: an SFT run reports eval/loss on its validation rows")
        records = load_table(self.source, self.split, hub_config=self.hub_config)
        require_fields(
            records, self.fields, f"{type(self).__name__} source {self.source}",
            "Set prompt_template/target_template to the fields your rows have (as {field}).",
        )
        check_records(records, template_types(self.fields), table_name(self.source, self.split),
                      "Templates print the fields they name: store that field as text, or fix or drop the row.")
        train, val = held_out_split(records, self.val_size, self.seed)
        return [self.row(r) for r in (val if split == "val" else train[: self.train_limit])]

    def row(self, record: dict[str, Any]) -> dict[str, Any]:
        target = self.target_template.format(**record)
        if self.strip is not None:
            target = self.strip.sub("", target)
        return {"prompt": self.prompt_template.format(**record), "target": target}

    def val_dataloader(self):
        if self.val_size:
            return super().val_dataloader()
        # no validation, on purpose: Lightning need not ask whether it was
        warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")
        return []


class GSM8KSolutionsDataModule(SFTDataModule):
    """GSM8K's training solutions as SFT targets (Tandem Training's skill-gap senior is first
    fine-tuned to write the calculator annotations ``<<48/2=24>>``, its "jargon").

    The prompt is ``GSM8KDataModule``'s (same default template), the target the full solution,
    step lines and final ``#### <number>`` line included, so that the fine-tuned model writes what
    ``GSM8KVerifier`` grades. With the default ``val_size`` and ``seed`` the held-out rows are the
    ones a tandem run with ``GSM8KDataModule``'s defaults validates on: SFT never trains on them.

    Args:
        source: Local folder with ``train.jsonl`` (openai/grade-school-math layout), a file, or
            the hub name ``openai/gsm8k``.
        annotations: Keep the calculator annotations (a jargon-speaking model); false strips
            them (``5*4 = <<5*4=20>>20`` becomes ``5*4 = 20``).
        prompt_template: Format string over the row's fields (``{question}``).
        val_size: Rows held out of the training split (seeded) for ``eval/loss``.
        train_limit: Use only the first N training rows (after the held-out slice).
        question_field: Field holding the problem text.
        answer_field: Field holding the solution that ends with ``#### <number>``.
        batch_size: Sequences per training step.
        eval_batch_size: Sequences per validation batch (default: batch_size).
        seed: Seed of the training order and of the held-out slice.
    """

    def __init__(
        self,
        source: str = "openai/gsm8k",
        annotations: bool = True,
        prompt_template: str = "Question: {question}\nAnswer:",
        val_size: int = 100,
        train_limit: int | None = None,
        question_field: str = "question",
        answer_field: str = "answer",
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        seed: int = 0,
    ):
        prompt_template = prompt_template.replace("{question}", "{" + question_field + "}")
        super().__init__(
            source=source,
            prompt_template=prompt_template,
            target_template=" {" + answer_field + "}",
            strip_pattern=None if annotations else JARGON,
            split="train",
            hub_config="main",
            val_size=val_size,
            train_limit=train_limit,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            seed=seed,
        )
        self.annotations = annotations
        self.answer_field = answer_field

    def row(self, record: dict[str, Any]) -> dict[str, Any]:
        final_answer(str(record[self.answer_field]))  # the target must be gradable
        return super().row(record)
