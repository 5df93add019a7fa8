"""QLoRA: a missing bitsandbytes is one clear line; on a GPU with bitsandbytes, a 4-bit senior with
LoRA adapters trains while FastEngine (not the HFEngine fallback) decodes a bf16 copy of the
dequantised base with the adapters merged, refreshed after each update."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import grouped_settings
from tests.test_evaluation import one_line_error

pytestmark = [pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode")]


@pytest.mark.usefixtures("in_repo")
def test_qlora_without_bitsandbytes_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # `import bitsandbytes` fails
    error = one_line_error(capsys, [
        "fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
        "--trainer.logger", "false", "--model.init_args.lora", "{r: 4, alpha: 8, load_in_4bit: true}",
    ])
    assert "needs bitsandbytes" in error and "pip install 'tandem-lit[qlora]'" in error and "load_in_4bit: false" in error


needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="QLoRA needs bitsandbytes")


@pytest.mark.gpu
@needs_bnb
def test_qlora_trains_on_gpu_and_the_fast_engine_decodes_the_merged_dequantised_copy(tmp_path):
    import lightning as L
    from peft.utils.integrations import dequantize_module_weight

    from tandem_lit.models import LoraSettings, ModelSource
    from tandem_lit.objectives import GRPO
    from tandem_lit.rollout import SamplingConfig, WordHandoff
    from tandem_lit.rollout.static import FastEngine
    from tandem_lit.training.module import TandemModule
    from tests.test_gpu_training import HasSpaceVerifier, Rows

    module = TandemModule(**grouped_settings(
        senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="bfloat16"),
        junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="bfloat16"),
        verifier=HasSpaceVerifier(), objective=GRPO(), handoff=WordHandoff(0.5),
        lora=LoraSettings(r=4, alpha=8, dropout=0.0, load_in_4bit=True),
        sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=32),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        eval_modes=["senior"], evaluate_at_start=False, completions_every_n_steps=0,
    ))
    module.configure_model()
    assert isinstance(module.engine, FastEngine), "a QLoRA senior must not fall back to HFEngine"
    devices = {p.device.type for p in module.senior.parameters()}
    assert devices == {"cuda"}, f"the 4-bit senior must be loaded on the GPU, found {devices}"
    quantized = [m for m in module.senior.modules() if type(m).__name__ == "Linear4bit"]
    assert quantized, "the base weights should be 4-bit"
    adapters = {n: p.detach().clone() for n, p in module.senior.named_parameters() if p.requires_grad}
    checked = []

    class CheckCopy(L.Callback):
        """After the last update, before Lightning moves the module back to the host."""

        def on_train_end(self, trainer, module):
            engine = module.rollouts.ready()  # the copy reloaded after the last update
            assert engine.decodes_copy and next(engine.senior.parameters()).dtype == torch.bfloat16
            # one projection of the copy = dequantised 4-bit base + scale * B @ A, as trained now
            layer = module.senior.get_base_model().model.layers[0].self_attn.q_proj
            base = dequantize_module_weight(layer.base_layer).float()
            delta = layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float()
            merged = base + layer.scaling["default"] * delta
            assert delta.abs().max() > 0, "the adapters were trained: the merge has something to add"
            copy = engine.senior.model.layers[0].self_attn.q_proj.weight.float()
            torch.testing.assert_close(copy, merged, rtol=2e-2, atol=2e-2)  # bf16 rounding of the copy
            checked.append(True)

    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
        callbacks=[CheckCopy()],
    )
    trainer.fit(module, datamodule=Rows(batch_size=4))
    assert checked == [True]
    assert all(torch.isfinite(torch.tensor(row["train/loss"])) for row in module.history if "train/loss" in row)
    assert any(not torch.equal(p.detach().cpu(), adapters[n].cpu()) for n, p in module.senior.named_parameters() if p.requires_grad)
