"""A tandem GRPO step on a GPU: FastEngine (CUDA graphs, Triton kernels) inside Lightning's loop.

Skipped without CUDA. Uses only torch, transformers, peft and lightning, so it runs on a GPU
machine without the CLI's extras.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from tandem_lit.data.base import PromptDataModule
from tandem_lit.models import LoraSettings, ModelSource
from tandem_lit.module import TandemModule
from tandem_lit.objectives import GRPO
from tandem_lit.rollout import SamplingConfig, WordHandoff
from tandem_lit.rollout.fast import FastEngine
from tandem_lit.verifiers.base import Grade, Verifier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class HasSpaceVerifier(Verifier):
    """Reward 1 when the completion contains a space: random tiny models get mixed groups."""

    def grade(self, completion: str, **columns) -> Grade:
        ok = " " in completion
        return Grade(correct=ok, reward=float(ok))


class Rows(PromptDataModule):
    def load_split(self, split):
        return [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(16)]


@pytest.mark.parametrize("setting", ["fp32", "bf16-mixed", "lora"])
def test_tandem_grpo_steps_on_gpu(tmp_path, setting):
    module = TandemModule(
        senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32"),
        junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="float32"),
        verifier=HasSpaceVerifier(),
        objective=GRPO(),
        handoff=WordHandoff(0.5),
        engine=FastEngine(),
        lora=LoraSettings(r=4, alpha=8) if setting == "lora" else None,
        sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=32),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        eval_modes=["senior", "tandem"],
        evaluate_at_start=False,
        completions_every_n_steps=0,
    )
    module.configure_model()
    senior_before = {n: p.detach().clone() for n, p in module.senior.named_parameters() if p.requires_grad}
    junior_before = copy.deepcopy(module.junior.state_dict())
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        precision="bf16-mixed" if setting == "bf16-mixed" else "32-true", default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=Rows(batch_size=4))
    assert trainer.global_step == 3
    assert module.engine.triton and module.engine._graphs, "the CUDA-graph Triton path should have run"
    moved = [n for n, p in module.senior.named_parameters() if p.requires_grad and not torch.equal(p.detach(), senior_before[n])]
    assert moved, "the senior should have been updated"
    for name, value in module.junior.state_dict().items():
        assert torch.equal(value, junior_before[name]), f"junior tensor {name} changed"
    steps = [row for row in module.history if "train/loss" in row]
    assert len(steps) == 3
    assert all(0.0 < row["train/junior_token_share"] < 1.0 for row in steps)
