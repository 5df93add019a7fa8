"""Liger-Kernel in the senior's training forward (``memory.fused_kernels``, ``models.liger``).

Without liger-kernel (CI): the switch, the one log line of ``auto``, the refusals of ``liger``.
With liger-kernel installed and no GPU, its Triton kernels run in Triton's interpreter on CPU
tensors (tests/liger_interpreted.py): log-probs and every parameter's gradient equal the PyTorch
path's in float32. The bf16 comparison on a GPU is tests/test_liger_gpu.py.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys

import lightning as L
import pytest
import torch

from tandem_lit.data.gsm8k import GSM8KDataModule
from tandem_lit.errors import ConfigError
from tandem_lit.models import liger
from tandem_lit.objectives import GRPO
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.training.settings import MemorySettings
from tandem_lit.verifiers.base import Grade, Verifier
from tests.conftest import REPO_ROOT, tiny_llama, tiny_tandem_module

pytestmark = [
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]

INSTALLED = importlib.util.find_spec("liger_kernel") is not None
CPU = torch.device("cpu")
needs_liger = pytest.mark.skipif(not INSTALLED, reason="needs liger-kernel")


class SpaceVerifier(Verifier):
    def grade(self, completion: str, **columns) -> Grade:
        return Grade(correct=" " in completion, reward=float(" " in completion))


class NoLiger:
    """A meta path finder that finds no liger-kernel, as where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "liger_kernel":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.fixture
def without_liger(monkeypatch):
    """liger-kernel as if not installed."""
    for name in [m for m in sys.modules if m.split(".")[0] == "liger_kernel"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoLiger(), *sys.meta_path])


# ------------------------------------------------------------------------------ the switch


def test_the_setting_takes_auto_liger_or_off():
    assert MemorySettings().fused_kernels == "auto"
    with pytest.raises(ConfigError, match="fused_kernels must be 'auto', 'liger' or 'off'"):
        MemorySettings(fused_kernels="yes")


def test_off_uses_nothing_and_says_nothing(caplog):
    with caplog.at_level(logging.INFO, logger=liger.__name__):
        assert liger.resolve("off", tiny_llama(40, seed=0), torch.device("cuda")) == ()
    assert not [r for r in caplog.records if r.name == liger.__name__]


def test_missing_liger_is_one_log_line_and_an_error_when_asked_for(without_liger, caplog):
    model = tiny_llama(40, seed=0)
    with caplog.at_level(logging.INFO, logger=liger.__name__):
        assert liger.resolve("auto", model, torch.device("cuda")) == ()
    [record] = [r for r in caplog.records if r.name == liger.__name__]
    assert "not installed" in record.getMessage() and "pip install 'tandem-lit[liger]'" in record.getMessage()
    with pytest.raises(ConfigError, match=r"fused_kernels is liger, but liger-kernel is not installed: pip install"):
        liger.resolve("liger", model, torch.device("cuda"))


def test_a_run_without_liger_logs_it_once_and_patches_nothing(without_liger, tmp_path, caplog):
    module = tiny_tandem_module(verifier=SpaceVerifier(), objective=GRPO(), mini_batch_size=1,
                                sampling=SamplingConfig(temperature=1.0, n=2, max_new_tokens=4))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu",
                        devices=1, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger=liger.__name__):
        trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
    [line] = [r.getMessage() for r in caplog.records if r.name == liger.__name__]
    assert line.startswith("Liger-Kernel not used: its Triton kernels need a CUDA GPU and the senior trains on cpu")
    assert not module.updates.fused_logprobs
    assert not any("forward" in m.__dict__ for m in module.senior.modules())


def test_architectures_liger_does_not_fit_are_named():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    assert liger.unsupported(tiny_llama(40, seed=0)) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2))
    assert "'gpt2' is not one Liger's kernels are wired for" in liger.unsupported(gpt2)
    lora_head = get_peft_model(tiny_llama(40, seed=0), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    assert "output head" in liger.unsupported(lora_head)


def test_liger_asked_for_on_a_cpu_is_refused(caplog):
    with pytest.raises(ConfigError, match="need a CUDA GPU and the senior trains on cpu: set memory.fused_kernels: auto or off"):
        liger.resolve("liger", tiny_llama(40, seed=0), CPU)
    with caplog.at_level(logging.INFO, logger=liger.__name__):
        assert liger.resolve("auto", tiny_llama(40, seed=0), CPU) == ()
    [record] = [r for r in caplog.records if r.name == liger.__name__]
    assert "need a CUDA GPU" in record.getMessage() and "pip install" not in record.getMessage()


@needs_liger
def test_with_liger_installed_a_gpu_senior_gets_the_kernels_that_fit_it(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="architecture 'gpt2'"):
        liger.resolve("liger", gpt2, torch.device("cuda"))
    llama = tiny_llama(40, seed=0)  # (resolved for a GPU, patched on the CPU: not run here)
    with caplog.at_level(logging.INFO, logger=liger.__name__):
        kernels = liger.resolve("auto", llama, torch.device("cuda"))
    assert kernels == ("rms_norm", "swiglu", "rope", "logprobs")
    assert any("in the senior's training forward: rms_norm, swiglu, rope, logprobs" in r.getMessage() for r in caplog.records)
    liger.apply_liger(llama, kernels)
    patched = {type(m).__name__ for m in llama.modules() if "forward" in m.__dict__}
    assert patched == {"LlamaRMSNorm", "LlamaMLP", "LlamaAttention"}
    liger.remove_liger(llama)
    assert not any("forward" in m.__dict__ for m in llama.modules())


# ------------------------------------------------------------- the kernels, interpreted on CPU


@pytest.mark.skipif(not INSTALLED or torch.cuda.is_available(), reason="needs liger-kernel, and no GPU (Triton's interpreter)")
def test_liger_kernels_equal_pytorch_in_float32():
    """tests/liger_interpreted.py in a fresh process: TRITON_INTERPRET is read when Triton and
    liger-kernel define their kernels."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "liger_interpreted.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["llama-padded", "qwen3-packed", "qwen3_5-padded", "qwen3-lora-padded", "llama-norm-kernel", "ok"]


@needs_liger
def test_a_norm_whose_input_and_weight_share_a_dtype_runs_torchs_fused_op(monkeypatch):
    """The float32 residual stream's norms run torch's ``rms_norm`` (a forward and backward a
    quarter of Liger's time on an H200, dev/log.md) and equal transformers' norm; a bf16
    input with a float32 weight (q/k norms under autocast) goes to Liger's kernel."""
    import liger_kernel.ops.rms_norm as liger_norm

    calls = []
    monkeypatch.setattr(liger_norm.LigerRMSNormFunction, "apply", lambda x, *args: calls.append(x.dtype) or x.float())
    model = tiny_llama(40, seed=0)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, norm.weight.shape[0])
    expected = norm(x)
    liger.apply_liger(model, ("rms_norm",))
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
    assert calls == []
    norm(x.bfloat16())
    assert calls == [torch.bfloat16]


@pytest.mark.parametrize("shape", [[], ["--completions", "3000", "2000", "1000"]], ids=["one-row", "unequal-rows"])
def test_update_kernels_benchmark_tiny(shape):
    """dev/benchmarks/update_kernels.py end to end on the CPU (PyTorch's path only), so the script the
    GPU numbers come from cannot rot unnoticed; with --completions, one pass of unequal rows padded
    to the longest (scaled to the tiny model's 24 tokens)."""
    run = subprocess.run([sys.executable, "dev/benchmarks/update_kernels.py", "--device", "cpu", "--tiny", *shape], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "off: trained pass" in run.stdout and run.stdout.strip().splitlines()[-1].startswith("off_update_s=")
    if shape:
        assert "8 + (24, 16, 8) padded to 24 tokens per pass" in run.stdout
