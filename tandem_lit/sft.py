"""Supervised fine-tuning with a prompt-masked loss: tandem-lit's own SFT path.

An example is a ``context`` the model conditions on but is not trained on (a prompt, plus any
prefix of the answer) and a ``target`` it learns to write, followed by the end-of-sequence token.
The loss is the mean cross-entropy over target tokens only.

``run_sft`` trains a causal LM in place with a Lightning Trainer; the offline demo builds its
senior and junior with it (``tandem_lit.demo.build``), and it serves any small warm-up fine-tune
before tandem RL.

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
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from tandem_lit.errors import ConfigError

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


def encode_examples(examples: list[SFTExample], tokenizer) -> list[tuple[list[int], int]]:
    """Token ids of each example and the length of its context: ``(ids, context_len)``.

    The context is encoded as the RL module encodes prompts (with the tokenizer's special tokens),
    the target without them, and the end-of-sequence token closes every target.
    """
    if tokenizer.eos_token_id is None:
        raise ConfigError("SFT needs a tokenizer with an end-of-sequence token")
    contexts = tokenizer([e.context for e in examples], add_special_tokens=True)["input_ids"]
    targets = tokenizer([e.target for e in examples], add_special_tokens=False)["input_ids"]
    return [(c + t + [tokenizer.eos_token_id], len(c)) for c, t in zip(contexts, targets)]


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


def target_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Mean next-token cross-entropy over target tokens (context and padding excluded)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, L, V]
    predicted = logits[:, :-1].float()
    wanted = batch["labels"][:, 1:]
    return F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), wanted.reshape(-1), ignore_index=IGNORE)


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

        def factor(step: int) -> float:
            if step < c.warmup_steps:
                return (step + 1) / c.warmup_steps
            progress = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps))
            return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
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
