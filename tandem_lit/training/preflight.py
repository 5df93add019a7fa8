"""Checks before the first step for settings that would not fail but silently change what a run
measures: each ends the run with one line naming the setting and the fix.

- **Token budgets against context lengths.** A model asked to write past its
  ``max_position_embeddings`` decodes at positions it was never trained on (rotary models do so
  without a word). For every phase the stage runs (training, validation, test, predict), the
  longest prompt of the data that phase reads plus its ``max_new_tokens`` must fit the context of
  each model that writes or reads those rollouts.
- **Vocabularies.** Every model needs a row for every token id its tokenizer can produce (a
  missing row indexes past the embedding). A pair that shares a tokenizer may have vocabularies
  of different sizes (checkpoints pad their embeddings to a multiple of 64 or 128): the rows past
  the tokenizer's ids are never sampled, because every engine samples from the tokenizer's ids
  only (``TandemDecoder`` and ``TextHandoffEngine`` cut the logits at ``len(tokenizer)``).
- **The verifier's columns.** Every row the stage reads has each column the verifier grades, of
  the type it grades (``Verifier.check_rows``): not a zero reward or an error steps later.
- **Packed update passes.** ``memory.pack_sequences`` needs a senior whose attention keeps packed
  sequences apart (``rollout.logprobs.check_packable``): refused here, not after the first rollouts.
- **A rounded KV cache needs a correction.** ``engine.kv_cache_dtype: fp8`` draws the senior's
  tokens from keys and values rounded to 8 bits, which the trainer's passes never round: the
  engine-vs-trainer mismatch grows (about twelvefold on the H100, docs/performance.md), so
  training needs the objective's ``tis_cap``, as ``rollout.partial.keep_caches: both`` does.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.logprobs import check_packable
from tandem_lit.rollout.record import Author

log = logging.getLogger(__name__)

Stage = Literal["fit", "validate", "test", "predict"]

# config attributes that hold a model's context length, by architecture family
CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def check_weight_precision(senior, allowed: bool) -> None:
    """A full-weight senior in bf16/fp16 would silently barely train (``update.allow_low_precision_weights``)."""
    dtype = next(senior.parameters()).dtype
    if dtype in (torch.bfloat16, torch.float16) and not allowed:
        raise ConfigError(
            f"the senior's weights are {dtype} and would be trained in place: optimiser updates below the "
            f"{dtype} rounding step vanish (at lr 1e-6 most AdamW updates do). Load it with dtype: float32 "
            "(add trainer.precision: bf16-mixed for bf16 compute), train LoRA adapters, or set "
            "update.allow_low_precision_weights: true if you mean it."
        )


def text_config(model):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_length(model) -> int | None:
    """The positions a model was trained on (None: its config does not say)."""
    config = text_config(model)
    for name in CONTEXT_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocabulary_rows(model) -> int | None:
    """Token ids the model has an embedding row and a logit for."""
    value = getattr(text_config(model), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None


def check_vocabularies(senior, junior, tokenizer, junior_tokenizer, names: dict[str, str]) -> None:
    """Each model has a row for every id of its tokenizer; a shared tokenizer's pair may differ
    only in rows no engine samples (said once)."""
    pairs = [("senior", senior, tokenizer)] + ([("junior", junior, junior_tokenizer or tokenizer)] if junior is not None else [])
    for role, model, tok in pairs:
        rows = vocabulary_rows(model)
        if rows is not None and rows < len(tok):
            raise ConfigError(
                f"the {role} ({names[role]}) has {rows} vocabulary rows (vocab_size) but its tokenizer has {len(tok)} "
                f"tokens: ids {rows}..{len(tok) - 1} would index past its embeddings. Give it the tokenizer it was "
                f"trained with{' (a junior that shares the senior tokenizer needs vocab_size >= ' + str(len(tok)) + ')' if role == 'junior' else ''}."
            )
    shared = junior is not None and (junior_tokenizer is None or junior_tokenizer.get_vocab() == tokenizer.get_vocab())
    if shared and vocabulary_rows(senior) != vocabulary_rows(junior):
        log.info(
            "senior and junior share a tokenizer of %d tokens; their vocabularies have %s and %s rows: the rows past "
            "id %d are never sampled (rollouts draw from the tokenizer's ids only)",
            len(tokenizer), vocabulary_rows(senior), vocabulary_rows(junior), len(tokenizer) - 1,
        )


def check_budget(setting: str, budget: int, prompt: int, data: str, role: str, name: str, context: int, fix: str) -> None:
    """``prompt`` tokens (the longest of ``data``) plus ``budget`` new ones fit ``context`` positions."""
    if prompt + budget <= context:
        return
    room = context - prompt
    lower = f"Lower {setting} to at most {room}" if room >= 1 else f"The prompt alone fills it: {fix}"
    raise ConfigError(
        f"{setting} {budget} plus the longest {data} prompt ({prompt} tokens) is {prompt + budget} positions, past the "
        f"{role}'s context length ({name}: max_position_embeddings {context}); it would write at positions it was "
        f"never trained on. {lower}{'' if room < 1 else ' (or ' + fix + ')'}."
    )


def longest_prompts(module: Any, rows: list[dict], limit: int | None) -> dict[str, int]:
    """The longest formatted prompt of ``rows`` for each model (prompts over ``limit`` are skipped
    by training, so they do not count)."""
    if not rows:
        return {}
    prompts = [row["prompt"] for row in rows]
    senior = [len(ids) for ids in module.rollouts.encode_prompts(prompts, padding=False)["input_ids"]]
    kept = [i for i, n in enumerate(senior) if limit is None or n <= limit]
    longest = {"senior": max((senior[i] for i in kept), default=0)}
    if module.junior is not None:
        rollouts = module.rollouts
        same = rollouts.settings.junior_prompt_format is None and (
            module.junior_tokenizer is None or module.junior_tokenizer.get_vocab() == module.tokenizer.get_vocab()
        )
        if same:
            longest["junior"] = longest["senior"]
        else:
            fmt = rollouts.settings.junior_prompt_format or rollouts.settings.prompt_format
            junior = rollouts.encode_prompts([prompts[i] for i in kept], module.junior_tokenizer or module.tokenizer,
                                             padding=False, fmt=fmt)["input_ids"]
            longest["junior"] = max((len(ids) for ids in junior), default=0)
    return longest


def phases(module: Any, stage: Stage) -> list[tuple[str, int, str, set[str], str]]:
    """(setting, budget, split, models that read the rollouts, fix for long prompts) of each phase ``stage`` runs."""
    evaluation = module.evaluation
    eval_roles = {"senior"} if "senior" in evaluation.modes else set()
    if module.junior is not None and {"junior", "tandem"} & set(evaluation.modes):
        eval_roles |= {"junior", "senior"} if "tandem" in evaluation.modes else {"junior"}
    shorten = "shorten or leave out the longest prompts"
    validation = ("evaluation.sampling.max_new_tokens", evaluation.sampling.max_new_tokens, "val", eval_roles, shorten)
    if stage == "fit":
        training_roles = {"senior"} | ({"junior"} if module.handoff.only_author != Author.SENIOR else set())
        sampling = module.sampling
        found = [("rollout.sampling.max_new_tokens", sampling.max_new_tokens, "train", training_roles,
                  "set rollout.max_prompt_tokens to skip longer prompts")]
        trainer = module._trainer
        if evaluation.at_start or trainer is None or trainer.limit_val_batches != 0:
            found.append(validation)
        return found
    if stage == "validate":
        return [validation]
    test_roles = {"senior", "junior"} if module.junior is not None else {"senior"}
    if stage == "test":
        return [("evaluation.test_sampling.max_new_tokens", evaluation.test_sampling.max_new_tokens, "test", test_roles, shorten)]
    return [("evaluation.sampling.max_new_tokens", evaluation.sampling.max_new_tokens, "test", eval_roles, shorten)]


def check_rounded_cache(engine: Any, objective: Any) -> None:
    """An 8-bit KV cache trains only with the objective's truncated importance weights (module
    docstring): an engine that caches in a dtype of its own (``kv_cache_bytes``) rounds what the
    model computed."""
    if engine is not None and engine.kv_cache_bytes() is not None and objective.tis_cap is None:
        raise ConfigError("engine.kv_cache_dtype: fp8 draws the senior's tokens from keys and values rounded to 8 bits, "
                          "which the trainer never rounds, so their log-probs differ more than the dtype's: set "
                          "objective.init_args.tis_cap (verl uses 2.0) to correct them, or kv_cache_dtype: auto")


def check(module: Any, stage: Stage) -> None:
    """Everything above for a TandemModule's ``stage``, before its first step (every rank runs it: each reads the
    same data and models)."""
    names = {"senior": module.senior_source.path, "junior": getattr(module.junior_source, "path", "")}
    check_vocabularies(module.senior, module.junior, module.tokenizer, module.junior_tokenizer, names)
    if stage == "fit" and module.memory.pack_sequences:
        check_packable(module.senior)
    if stage == "fit":
        check_rounded_cache(module.engine, module.objective)
    models = {"senior": module.senior, "junior": module.junior}
    contexts = {role: context_length(model) for role, model in models.items() if model is not None}
    datamodule = getattr(module._trainer, "datamodule", None) if module._trainer is not None else None
    read_rows = getattr(datamodule, "rows", None)
    if read_rows is not None:  # the columns the verifier grades, of its types, in every row the stage reads
        for split in dict.fromkeys(phase[2] for phase in phases(module, stage)):
            module.verifier.check_rows(read_rows(split), f"{type(datamodule).__name__} {split} rows")
    for setting, budget, split, roles, fix in phases(module, stage):
        if not any(contexts.get(role) for role in roles):
            continue
        limit = module.rollout_settings.max_prompt_tokens if split == "train" else None
        longest = longest_prompts(module, read_rows(split), limit) if read_rows is not None else {}
        if not longest and limit is not None:  # data we cannot read ahead: prompts up to the limit
            longest = {"senior": limit, "junior": limit}
        data = {"train": "training", "val": "validation", "test": "test"}[split]
        for role in sorted(roles):
            context = contexts.get(role)
            if context is not None:
                check_budget(setting, budget, longest.get(role, 0), data, role, names[role], context, fix)
