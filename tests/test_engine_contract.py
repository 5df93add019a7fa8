"""The engine contract (``RolloutEngine``): an engine written from it alone trains, and training
reads nothing of an engine that the contract does not declare."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import tiny_tandem_module

from tandem_lit.data import GSM8KDataModule
from tandem_lit.objectives import SoftMaskedReinforce
from tandem_lit.rollout import PromptBatch, Rollout, RolloutEngine, SamplingConfig
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.verifiers import GSM8KVerifier

pytestmark = [
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]

PACKAGE = Path(__file__).resolve().parents[1] / "tandem_lit"


class UncachedEngine(RolloutEngine):
    """``generate``, the contract's one abstract member, and nothing else: each step runs both
    models over the whole sequence so far (no KV cache) and hands their last logits to the
    contract's decoder, which samples, draws the handoffs and records who wrote each token."""

    def generate(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig) -> Rollout:
        prompts = prompts.to(next(self.senior.parameters()).device)
        decoder = self.decoder(prompts, policy, sampling)
        ids, mask = prompts.input_ids, prompts.attention_mask
        models = {"senior": self.senior if decoder.needs_senior else None, "junior": self.junior if decoder.needs_junior else None}
        with torch.no_grad():
            for _ in range(int(decoder.budget.max())):
                positions = (mask.cumsum(-1) - 1).clamp_min(0)
                logits = {name: model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
                          if model is not None else None for name, model in models.items()}
                token = decoder.step(logits["senior"], logits["junior"])
                ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                if decoder.all_finished():
                    break
        return decoder.finish(prompts, self.tokenizer)


def test_an_engine_written_from_the_contract_alone_trains_a_step(tmp_path):
    """Two tiny steps through TandemModule: the engine is set up with ``rollout.batch_size`` as
    its ``max_batch``, gets calls of at most that many sequences (it does not queue rows), and its
    bf16 rollout copy is refreshed through the contract's ``load_weights`` after the update."""
    engine = UncachedEngine()
    engine.rollout_dtype = "bfloat16"  # a rollout copy to refresh (the tiny senior trains in float32)
    calls = []
    generate = engine.generate
    engine.generate = lambda prompts, policy, sampling: calls.append(prompts.batch_size) or generate(prompts, policy, sampling)
    module = tiny_tandem_module(
        verifier=GSM8KVerifier(), objective=SoftMaskedReinforce(), engine=engine, rollout_batch_size=2,
        sampling=SamplingConfig(temperature=1.0, n=2, max_new_tokens=8),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )
    module.configure_model()
    before = {name: p.detach().clone() for name, p in module.senior.named_parameters()}
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu",
                        devices=1, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
    assert trainer.global_step == 2
    assert engine.max_batch == 2 and calls == [2, 2, 2, 2]  # 2 prompts x n 2 per step, in calls of 2
    assert engine.decodes_copy and engine.weights_version == 1  # the first update reached the second step's copy
    assert any(not torch.equal(p, before[name]) for name, p in module.senior.named_parameters())
    rows = [row for row in module.history if "train/loss" in row]
    assert len(rows) == 2 and all(row["train/rollout_seconds"] > 0 for row in rows)
    assert not any("train/rollout_decode_seconds" in row for row in rows)  # it does not time its calls


def engine_reads(path: Path) -> tuple[set[str], list[str]]:
    """The attributes ``path`` reads of an engine (``engine.x``, ``self.engine.x``), and its
    ``getattr``/``hasattr`` calls on one."""
    def is_engine(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "engine") or (isinstance(node, ast.Attribute) and node.attr == "engine")

    read, probed = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and is_engine(node.value):
            read.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if node.args and is_engine(node.args[0]):
                probed.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return read, probed


def test_training_reads_only_what_the_contract_declares():
    files = [*PACKAGE.glob("training/*.py"), *PACKAGE.glob("evaluation/*.py")]
    reads = [engine_reads(path) for path in files]
    used = set().union(*(read for read, _ in reads))
    declared = {name for cls in RolloutEngine.__mro__ for name in (*vars(cls), *getattr(cls, "__annotations__", {}))}
    assert "generate" in used and "load_weights" in used and "plan_kv_cache" in used  # (the scan sees them)
    assert used <= declared, f"read by training, not declared on RolloutEngine: {sorted(used - declared)}"
    assert not [where for _, probed in reads for where in probed], "getattr/hasattr on an engine outside the engines"
