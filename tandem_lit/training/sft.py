"""Supervised fine-tuning with a prompt-masked loss: tandem-lit's own SFT path.

An example is a ``context`` the model conditions on but is not trained on (a prompt, plus any
prefix of the answer) and a ``target`` it learns to write, followed by the end-of-sequence token.
The loss is the mean cross-entropy over target tokens only.

Two ways in:

- ``SFTModel``, the model class of ``tandem-lit fit`` for supervised runs (rows from
  ``tandem_lit.data.sft_data``): a hub or local model, full weights, LoRA or QLoRA; it writes a
  Hugging Face folder (adapters merged, tokenizer included) that a tandem config takes as
  ``senior.path`` / ``junior.path``. docs/sft.md has the recipes.

      tandem-lit fit --config configs/paper_a/sft_jargon_llama2.yaml

- ``run_sft`` trains a causal LM in place with a Lightning Trainer; the offline demo builds its
  senior and junior with it (``tandem_lit.demo.build``).

      losses = run_sft(model, tokenizer, [SFTExample("Question: 2+2?\\nAnswer:", " 4")], SFTConfig(steps=100))
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from tandem_lit.errors import ConfigError
from tandem_lit.models import (
    DTYPES,
    LoraSettings,
    ModelSource,
    apply_lora,
    load_causal_lm,
    load_tokenizer,
    quantization_config,
)
from tandem_lit.runs import start_run_record
from tandem_lit.training import checkpoints
from tandem_lit.training.settings import PromptFormat

log = logging.getLogger(__name__)

IGNORE = -100  # label of a token the loss skips (context and padding)


@dataclass(frozen=True)
class SFTExample:
    """One training sequence: ``context`` is conditioned on, ``target`` (+ end token) is learned."""

    context: str
    target: str


@dataclass
class SFTConfig:
    """One supervised phase.

    Args:
        steps: Optimiser steps (one pass over ``steps x batch_size`` examples, cycled if fewer).
        batch_size: Sequences per step.
        lr: Peak AdamW learning rate (linear warm-up, cosine decay to ``min_lr_ratio x lr``).
        warmup_steps: Linear warm-up steps.
        min_lr_ratio: Final learning rate as a fraction of ``lr``.
        weight_decay: AdamW weight decay.
        max_grad_norm: Gradient clipping (None: off).
        seed: Seed of the example order.
        log_every: Print the running loss every this many steps (0: silent).
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    seed: int = 0
    log_every: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError(f"SFT needs steps >= 1 and batch_size >= 1, got {self.steps} and {self.batch_size}")


def encode_examples(
    examples: list[SFTExample], tokenizer, add_special_tokens: bool = True
) -> list[tuple[list[int], int]]:
    """Token ids of each example and the length of its context: ``(ids, context_len)``.

    The context is encoded as the RL module encodes prompts (``add_special_tokens``: the
    tokenizer's special tokens, unless a chat template brought its own), and the target as the
    continuation the model would write after it: context and target are encoded together, so that
    a tokenizer that marks word starts (SentencePiece's ``▁``) does not see the target as a text
    of its own. Where the joint encoding does not begin with the context's tokens (a merge across
    the boundary), the target is encoded alone. The end-of-sequence token closes every target.
    """
    if tokenizer.eos_token_id is None:
        raise ConfigError("SFT needs a tokenizer with an end-of-sequence token")
    contexts = tokenizer([e.context for e in examples], add_special_tokens=add_special_tokens)["input_ids"]
    joint = tokenizer([e.context + e.target for e in examples], add_special_tokens=add_special_tokens)["input_ids"]
    encoded = []
    for example, context, ids in zip(examples, contexts, joint):
        if ids[: len(context)] != context:
            ids = context + tokenizer(example.target, add_special_tokens=False)["input_ids"]
        encoded.append((ids + [tokenizer.eos_token_id], len(context)))
    return encoded


def collate(encoded: list[tuple[list[int], int]], pad_token_id: int) -> dict[str, Tensor]:
    """Right-padded batch; ``labels`` hold the token ids on target positions, IGNORE elsewhere."""
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_token_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)  # [B, L]
    labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)  # [B, L]
    for row, (ids, context_len) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, context_len : len(ids)] = torch.tensor(ids[context_len:])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def target_cross_entropy(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Summed next-token cross-entropy over target tokens, and their count (context and padding
    excluded): ``(sum, count)``, so that several batches average over tokens exactly."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, L, V]
    predicted = logits[:, :-1].float()
    wanted = batch["labels"][:, 1:]
    total = F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), wanted.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return total, (wanted != IGNORE).sum()


def target_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Mean next-token cross-entropy over target tokens (context and padding excluded)."""
    total, count = target_cross_entropy(model, batch)
    return total / count


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to the peak, then cosine decay to ``min_lr_ratio x`` peak at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class SFTModule(L.LightningModule):
    """Trains ``model`` on prompt-masked batches from ``collate``."""

    def __init__(self, model: nn.Module, config: SFTConfig):
        super().__init__()
        self.model = model
        self.config = config
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = target_loss(self.model, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        c = self.config
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay, betas=(0.9, 0.98))

        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, c.warmup_steps, c.steps, c.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _PrintLoss(L.Callback):
    def __init__(self, every: int, label: str):
        self.every = every
        self.label = label
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module: SFTModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every == 0 or step == pl_module.config.steps:
            recent = pl_module.losses[-self.every :]
            print(
                f"  {self.label} step {step:>5}/{pl_module.config.steps}  loss {sum(recent) / len(recent):.3f}  "
                f"{time.perf_counter() - self.started:5.0f} s",
                file=sys.stderr,
                flush=True,
            )


@contextlib.contextmanager
def _quiet_lightning():
    """No "GPU available" banners or dataloader-worker hints from an in-process fine-tune."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
            yield
    finally:
        logger.setLevel(level)


def run_sft(model: nn.Module, tokenizer, examples: list[SFTExample], config: SFTConfig, label: str = "sft") -> list[float]:
    """Fine-tune ``model`` in place on ``examples`` with a CPU Lightning Trainer; returns the
    per-step losses. Deterministic given the model's initial weights and ``config.seed``."""
    if not examples:
        raise ConfigError("run_sft got no examples")
    encoded = encode_examples(examples, tokenizer)
    needed = config.steps * config.batch_size
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(config.seed)).tolist()
    order = (order * math.ceil(needed / len(order)))[:needed]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    loader = DataLoader(
        [encoded[i] for i in order], batch_size=config.batch_size, shuffle=False, collate_fn=lambda b: collate(b, pad)
    )
    module = SFTModule(model, config)
    callbacks = [_PrintLoss(config.log_every, label)] if config.log_every else []
    with _quiet_lightning(), tempfile.TemporaryDirectory(prefix="tandem-lit-sft-") as scratch:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=config.steps,
            max_epochs=-1,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            gradient_clip_val=config.max_grad_norm,
            callbacks=callbacks,
            default_root_dir=scratch,
        )
        model.train()
        trainer.fit(module, train_dataloaders=loader)
    model.eval()
    return module.losses


# ------------------------------------------------------------------------ tandem-lit fit (CLI)

# jsonargparse builds this from `class_path: torch.optim.AdamW` + init_args, leaving the params out
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]


class SFTModel(L.LightningModule):
    """Supervised fine-tuning of one model from ``tandem-lit fit``: prompt-masked loss over the
    rows of an ``SFTDataModule`` (``prompt`` = context, ``target`` = what the model learns to
    write), then a Hugging Face folder a tandem config takes as ``senior.path`` / ``junior.path``.

    One training step: encode the batch's rows (``encode_examples``: the context formatted as
    ``TandemModule`` formats prompts, the target + end token after it), mean cross-entropy over the
    target tokens of the batch, one optimiser update (Lightning's automatic optimisation:
    ``trainer.accumulate_grad_batches`` and ``trainer.gradient_clip_val`` apply). Logged at
    x = updates so far: ``train/loss`` (mean over the update's target tokens), ``train/lr``,
    ``train/grad_norm`` (before clipping), ``train/target_tokens``; ``eval/loss`` on the
    validation rows.

    Args:
        model: The model to fine-tune (hub name or folder), as ``senior`` of a tandem config.
        lora: Train LoRA adapters (QLoRA with ``load_in_4bit``) instead of full weights; the
            saved folder holds the adapters merged into the base weights.
        optimizer: Optimizer factory (default AdamW, lr 1e-4, no weight decay).
        warmup_steps: Linear learning-rate warm-up over this many updates.
        min_lr_ratio: Cosine decay from the peak to ``min_lr_ratio x`` peak over the run's
            updates (``trainer.max_steps``); 1.0 keeps the rate constant after the warm-up.
        prompt_format: Prompt template and chat template use. Keep it as in the tandem run that
            will use the model (its ``prompt_format`` for a senior, ``junior_prompt_format`` for a
            junior): the context is formatted exactly as ``TandemModule`` formats a prompt.
        gradient_checkpointing: Recompute activations in the backward pass (less memory).
        allow_low_precision_weights: Train full weights held in bfloat16/float16 (see
            ``TandemModule``: small AdamW updates vanish in bf16 weights).
        evaluate_at_start: Compute ``eval/loss`` once before the first update (step 0).
        hf_folder: Where the fine-tuned model is saved when training ends (default:
            ``<run folder>/hf``).
        hf_every_n_steps: Also save ``<hf_folder>-step<N>`` every N updates (0: at the end only).
        hf_dtype: Dtype of the saved weights (default: the model's ``dtype``; bfloat16 for a
            4-bit QLoRA base, which is saved dequantised).
        seed: Seed of the dropout masks, drawn afresh for each batch from (seed, epoch, batch), so
            that a resumed run draws the masks the uninterrupted run would have.
    """

    def __init__(
        self,
        model: ModelSource,
        lora: LoraSettings | None = None,
        optimizer: OptimizerCallable | None = None,
        warmup_steps: int = 0,
        min_lr_ratio: float = 1.0,
        prompt_format: PromptFormat | None = None,
        gradient_checkpointing: bool = False,
        allow_low_precision_weights: bool = False,
        evaluate_at_start: bool = True,
        hf_folder: str | None = None,
        hf_every_n_steps: int = 0,
        hf_dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        seed: int = 0,
    ):
        super().__init__()
        if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0 or hf_every_n_steps < 0:
            raise ConfigError(
                f"SFTModel needs warmup_steps >= 0, 0 <= min_lr_ratio <= 1 and hf_every_n_steps >= 0; got "
                f"{warmup_steps}, {min_lr_ratio} and {hf_every_n_steps}"
            )
        self.strict_loading = False  # checkpoints hold trainable weights only (see on_save_checkpoint)
        self.model_source = model
        self.lora = lora
        # now, not when the weights load: a missing bitsandbytes is one line before anything runs
        self.quantization = quantization_config(lora)
        self.optimizer_factory = optimizer
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.prompt_format = prompt_format or PromptFormat()
        self.gradient_checkpointing = gradient_checkpointing
        self.allow_low_precision_weights = allow_low_precision_weights
        self.evaluate_at_start = evaluate_at_start
        self.hf_folder = hf_folder
        self.hf_every_n_steps = hf_every_n_steps
        self.hf_dtype = hf_dtype
        self.seed = seed
        self.model: nn.Module | None = None
        self.tokenizer = None
        self.run_id: str | None = None  # set when fit starts; kept by checkpoints across resumes
        self.history: list[dict[str, float]] = []  # every logged row, for RunReport (history.jsonl, summary)
        self._update_totals = torch.zeros(2)  # [summed target cross-entropy, target tokens] since the last update
        self._eval_totals = torch.zeros(2)
        self._hf_saved_at: int | None = None

    # ----------------------------------------------------------------------------------- model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.tokenizer = load_tokenizer(self.model_source)
        model = load_causal_lm(self.model_source, self.quantization)
        if self.lora is None:
            dtype = next(model.parameters()).dtype
            if dtype in (torch.bfloat16, torch.float16) and not self.allow_low_precision_weights:
                raise ConfigError(
                    f"the model's weights are {dtype} and would be trained in place: AdamW updates below the {dtype} "
                    "rounding step vanish. Load it with dtype: float32 (add trainer.precision: bf16-mixed for bf16 "
                    "compute), train LoRA adapters, or set allow_low_precision_weights: true if you mean it."
                )
        else:
            model = apply_lora(model, self.lora)
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model

    def on_fit_start(self) -> None:
        if self.trainer.world_size > 1:
            raise ConfigError(
                f"SFTModel trains on one process; this run has {self.trainer.world_size}. Set trainer.devices: 1 "
                "(a 7B model with QLoRA fits one GPU)."
            )
        self.run_id = start_run_record(self.trainer, self.run_id)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        what = "full weights" if self.lora is None else f"LoRA r={self.lora.r}" + (" on a 4-bit base" if self.quantization else "")
        log.info("SFT of %s (%s): %s of %s parameters train", self.model_source.path, what, f"{trainable:,}", f"{total:,}")

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params) if self.optimizer_factory else torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, self.warmup_steps, total, self.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------ steps

    def format_context(self, prompt: str) -> str:
        """The model input for a row's prompt, as the tandem run formats it (``PromptFormat.render``)."""
        return self.prompt_format.render(prompt, self.tokenizer)

    def uses_chat_template(self) -> bool:
        return self.prompt_format.uses_chat_template(self.tokenizer)

    def encode(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        """A padded batch (``collate``) of the rows' contexts and targets, on the module's device."""
        examples = [SFTExample(self.format_context(row["prompt"]), row["target"]) for row in rows]
        encoded = encode_examples(examples, self.tokenizer, add_special_tokens=not self.uses_chat_template())
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return {name: tensor.to(self.device) for name, tensor in collate(encoded, pad).items()}

    def training_step(self, batch, batch_idx: int) -> Tensor:
        # Dropout masks from (seed, epoch, batch): the same on a resumed run, whatever ran before.
        torch.manual_seed(self.seed * 1_000_003 + getattr(batch, "epoch", 0) * 100_003 + getattr(batch, "index", batch_idx))
        total, count = target_cross_entropy(self.model, self.encode(list(batch)))
        self._update_totals += torch.stack([total.detach().float(), count.float()]).cpu()
        loss = total / count
        self.log("train/loss", loss.detach(), batch_size=len(batch), logger=False)  # for callbacks (monitor)
        if hasattr(batch, "mark_consumed"):  # before ResumeCheckpoint saves, in on_train_batch_end
            batch.mark_consumed()
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Once per update, after its last backward pass (so the row reaches the checkpoint saved
        # at the end of this batch), before clipping.
        grads = [p.grad.detach().float().norm() for p in self.model.parameters() if p.grad is not None]
        total, count = self._update_totals.tolist()
        self._update_totals.zero_()
        self.log_row({
            "train/loss": total / max(count, 1.0),
            "train/target_tokens": count,
            "train/lr": optimizer.param_groups[0]["lr"],
            "train/grad_norm": float(torch.stack(grads).norm()) if grads else 0.0,
        }, step=self.global_step + 1)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        every = self.hf_every_n_steps
        if every and self.global_step and self.global_step % every == 0 and self._hf_saved_at != self.global_step:
            self.save_hf(f"{self.output_folder()}-step{self.global_step}")
            self._hf_saved_at = self.global_step

    def on_train_end(self) -> None:  # after ResumeCheckpoint saved last.ckpt
        out = self.save_hf(self.output_folder())
        log.info("tandem-lit: saved the fine-tuned model to %s (use it as senior.path or junior.path)", out)

    def validation_step(self, batch, batch_idx: int) -> None:
        total, count = target_cross_entropy(self.model, self.encode(list(batch)))
        self._eval_totals += torch.stack([total.float(), count.float()]).cpu()

    def on_validation_epoch_end(self) -> None:
        total, count = self._eval_totals.tolist()
        self._eval_totals.zero_()
        if count:
            self.log("eval/loss", total / count, logger=False)  # for callbacks (best_checkpoint monitor)
            if not self.trainer.sanity_checking:
                self.log_row({"eval/loss": total / count}, step=self.global_step)

    def on_train_start(self) -> None:
        if not self.evaluate_at_start or self.global_step > 0 or not self.trainer.val_dataloaders:
            return
        self.model.eval()
        with torch.no_grad():
            for batch in self.trainer.val_dataloaders:
                self.validation_step(batch, 0)
        self.model.train()
        total, count = self._eval_totals.tolist()
        self._eval_totals.zero_()
        if count:
            self.log_row({"eval/loss": total / count}, step=0)
            log.info("evaluation before training: eval/loss %.4f", total / count)

    def log_row(self, row: dict[str, float], step: int) -> None:
        """Log ``row`` at x = ``step`` optimiser updates, and keep it in the history."""
        for logger in self.loggers:
            logger.log_metrics(row, step=step)
        self.history.append({"step": step, **row})

    # ----------------------------------------------------------------------------------- output

    def output_folder(self) -> Path:
        return Path(self.hf_folder).expanduser() if self.hf_folder else Path(self.trainer.default_root_dir) / "hf"

    def save_hf(self, out: str | Path) -> Path:
        """Write the model (adapters merged) and its tokenizer as a Hugging Face folder."""
        dtype = DTYPES[self.hf_dtype] if self.hf_dtype else (torch.bfloat16 if self.quantization else self.model_source.torch_dtype())
        return save_hf_folder(self.model, self.tokenizer, out, dtype)

    # ---------------------------------------------------------------------------- checkpointing

    def trainable_keys(self) -> set[str]:
        return {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep what training changes (all weights, or the adapters); frozen base weights are
        rebuilt from ``model`` on load."""
        trainable = self.trainable_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["tandem_lit"] = {"trainable_keys": sorted(trainable), "history": self.history, "run_id": self.run_id}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        missing = self.trainable_keys() - set(checkpoint.get("state_dict", {}))
        if missing:
            raise ConfigError(
                f"checkpoint does not match this model: {len(missing)} trainable tensors missing (e.g. "
                f"{sorted(missing)[:3]}); resume with the model and lora settings it was trained with"
            )
        checkpoints.raise_on_other_shapes({f"model.{n}": p for n, p in self.model.named_parameters()},
                                          checkpoint.get("state_dict", {}), "resume with the model it was trained with")
        self.history = list(checkpoint.get("tandem_lit", {}).get("history", []))
        self.run_id = checkpoint.get("tandem_lit", {}).get("run_id") or self.run_id


def save_hf_folder(model: nn.Module, tokenizer, out: str | Path, dtype: torch.dtype) -> Path:
    """``model`` as a plain Hugging Face folder in ``dtype``: LoRA adapters merged into the base
    weights, a 4-bit base dequantised (``rollout_named_tensors``, the path the rollout engine and
    ``tandem-lit export`` use), with the tokenizer and generation config. Loads with
    ``AutoModelForCausalLM.from_pretrained``."""
    import copy

    from tandem_lit.rollout.weights import build_rollout_copy, load_named_tensors, rollout_named_tensors

    plain = build_rollout_copy(model, dtype)
    load_named_tensors(plain, rollout_named_tensors(model))
    plain.config = copy.deepcopy(plain.config)
    for attribute in ("quantization_config", "_pre_quantization_dtype"):  # the saved weights are plain
        if hasattr(plain.config, attribute):
            delattr(plain.config, attribute)
    out = Path(out)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
