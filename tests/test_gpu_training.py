"""A tandem GRPO step on a GPU: FastEngine (CUDA graphs, Triton kernels) inside Lightning's loop.

Skipped without CUDA. Uses only torch, transformers, peft and lightning, so it runs on a GPU
machine without the CLI's extras.
"""

from __future__ import annotations

import collections
import copy
import math
import warnings

import lightning as L
import pytest
import torch

from tandem_lit.data.base import PromptDataModule
from tandem_lit.models import LoraSettings, ModelSource
from tandem_lit.objectives import GRPO
from tandem_lit.rollout import SamplingConfig, WordHandoff
from tandem_lit.rollout.static import FastEngine
from tandem_lit.training.module import TandemModule
from tandem_lit.training.settings import MemorySettings
from tandem_lit.verifiers.base import Grade, Verifier
from tests.conftest import grouped_settings

pytestmark = pytest.mark.gpu


class HasSpaceVerifier(Verifier):
    """Reward 1 when the completion contains a space: random tiny models get mixed groups."""

    def grade(self, completion: str, **columns) -> Grade:
        ok = " " in completion
        return Grade(correct=ok, reward=float(ok))


class Rows(PromptDataModule):
    def load_split(self, split):
        return [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(16)]


class OptimizerPlacement(L.Callback):
    """Whether all optimizer moments are on the GPU at the end of each training step."""

    def __init__(self):
        self.on_gpu = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        self.on_gpu.append(bool(state) and all(v.is_cuda for v in state))


@pytest.mark.parametrize("setting", ["fp32", "bf16-mixed", "lora", "offload"])
def test_tandem_grpo_steps_on_gpu(tmp_path, setting):
    """float32 master weights (and LoRA) train while the engine decodes its bf16 copy, refreshed
    after every update; ``offload``: AdamW state on the host during rollouts, back for the update."""
    module = TandemModule(**grouped_settings(
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
        memory=MemorySettings(offload_optimizer=setting == "offload"),
    ))
    module.configure_model()
    senior_before = {n: p.detach().clone() for n, p in module.senior.named_parameters() if p.requires_grad}
    junior_before = copy.deepcopy(module.junior.state_dict())
    placement = OptimizerPlacement()
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False, callbacks=[placement],
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        precision="bf16-mixed" if setting == "bf16-mixed" else "32-true", default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=Rows(batch_size=4))
    assert trainer.global_step == 3
    engine = module.engine
    assert engine.triton and engine.decodes_copy and next(engine.senior.parameters()).dtype == torch.bfloat16
    assert engine.weights_version == 2, "the copy is reloaded before each rollout after an update"
    assert not engine._graphs and engine._batch is None, "caches and graphs are released before each update"
    moved = [n for n, p in module.senior.named_parameters() if p.requires_grad and not torch.equal(p.detach(), senior_before[n])]
    assert moved, "the senior should have been updated"
    for name, value in module.junior.state_dict().items():
        assert torch.equal(value, junior_before[name]), f"junior tensor {name} changed"
    steps = [row for row in module.history if "train/loss" in row]
    assert len(steps) == 3
    assert all(0.0 < row["train/junior_token_share"] < 1.0 for row in steps)
    # the bf16 copy against the float32 training model: measured, never zero; small without autocast
    # (under bf16-mixed the training forward itself runs in bf16, so the gap is larger: H200, 2026-12-01)
    gaps = [row["train/rollout_logp_gap_mean"] for row in steps]
    assert all(0 < gap < math.inf for gap in gaps), gaps
    if setting in ("fp32", "lora", "offload"):
        assert all(gap < 0.5 for gap in gaps), gaps
    assert all(row["train/rollout_setup_seconds"] > 0 and row["train/decode_step_ms"] > 0 for row in steps)
    # each phase's own peak, beside the plan made when fit started: the rollout's holds the engine's
    # caches, which are released before the update
    for row in steps:
        assert 0 < row["train/rollout_peak_memory_gb"] and 0 < row["train/update_peak_memory_gb"]
        assert row["train/peak_memory_gb"] == max(row["train/rollout_peak_memory_gb"], row["train/update_peak_memory_gb"])
        assert row["train/rollout_memory_plan_gb"] > 0 and row["train/update_memory_plan_gb"] > 0
    # after each step (the update just ran) the AdamW moments are on the GPU, offloaded or not
    assert placement.on_gpu == [True, True, True]


def test_fsdp2_on_one_gpu_shards_the_senior_and_decodes_a_bf16_copy_of_the_gathered_weights(tmp_path):
    """The FSDP2 path on CUDA (NCCL, bf16 mixed-precision policy, the root unit's registered
    training forward, the copy filled inside ``gathered``); one process, so no sharing of rows."""
    from tandem_lit.rollout.weights import gathered, is_sharded, rollout_named_tensors
    from tandem_lit.training.distributed import FSDP2Strategy

    module = TandemModule(**grouped_settings(
        senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32"),
        junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="float32"),
        verifier=HasSpaceVerifier(), objective=GRPO(), handoff=WordHandoff(0.5), engine=FastEngine(),
        sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=32),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        eval_modes=["senior", "tandem"], evaluate_at_start=False, completions_every_n_steps=0,
    ))
    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=FSDP2Strategy(), max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        precision="bf16-mixed", default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=Rows(batch_size=4))
    assert trainer.global_step == 3 and is_sharded(module.senior)
    engine = module.engine
    assert engine.triton and engine.decodes_copy and engine.weights_version == 2
    steps = [row for row in module.history if "train/loss" in row]
    assert all(0 < row["train/rollout_logp_gap_mean"] < 0.5 and math.isfinite(row["train/grad_norm"]) for row in steps)
    with gathered(module.senior):  # what the next rollout phase does after the last update
        engine.load_weights(rollout_named_tensors(module.senior))
    copy_weights = dict(engine.senior.named_parameters())
    for name, param in module.senior.named_parameters():
        assert torch.equal(copy_weights[name], param.full_tensor().to(torch.bfloat16)), name


def update_syncs(tmp_path, micro_batch_size: int) -> collections.Counter:
    """Host waits on the GPU (CUDA's sync debug mode) inside one step's update of 16 rows, by
    the Python line that waited."""
    module = TandemModule(**grouped_settings(
        senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32"),
        junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="float32"),
        verifier=HasSpaceVerifier(), objective=GRPO(), handoff=WordHandoff(0.5), engine=FastEngine(),
        sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=32), micro_batch_size=micro_batch_size,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), eval_modes=["senior"], evaluate_at_start=False,
        completions_every_n_steps=0, memory=MemorySettings(fused_kernels="off"),  # Liger's head reads a count back
    ))
    run, counted = module.updates.run, []

    def counting(*args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return run(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                counted.append(collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)))

    module.updates.run = counting
    L.Trainer(accelerator="gpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, precision="bf16-mixed",
              default_root_dir=str(tmp_path / str(micro_batch_size))).fit(module, datamodule=Rows(batch_size=4))
    assert len(counted) == 1
    return counted[0]


def test_an_updates_passes_queue_on_the_gpu_without_waiting_for_it(tmp_path):
    """The host reads back from the GPU per update (lengths, normalisers, the gradient norm, the
    metrics), never per pass: 16 passes wait as often as 4 do, so the host launches a pass's
    kernels while the GPU still runs the previous ones."""
    update_syncs(tmp_path / "warm-up", micro_batch_size=4)  # what waits once per process (CUDA's lazy set-ups)
    few, many = update_syncs(tmp_path, micro_batch_size=4), update_syncs(tmp_path, micro_batch_size=1)
    assert 0 < many.total() == few.total(), (few - many, many - few)  # the lines that waited more often
