"""The rollout phase's memory as it really runs (a prefill beside the pool, the decode step's
buffers, the allocator's slack), the pool and prefill sized from the card (``kv_cache_gib:
auto``), the refusal of full weights on one H100, and a CUDA out-of-memory as one line."""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import pytest
import torch
import yaml

from tandem_lit.errors import ConfigError, DeviceMemoryError
from tandem_lit.rollout import out_of_memory
from tandem_lit.training.memory import (
    ALLOCATOR_SLACK,
    CARD_HEADROOM,
    DECODE_VOCAB_BYTES,
    GIB,
    PREFILL_SHARE,
    MemoryBudgetError,
    ModelShape,
    StepSettings,
    estimate_module_memory,
    estimate_step_memory,
    kv_budget,
    size_rollout_memory,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.usefixtures("in_repo"), pytest.mark.filterwarnings("ignore:No seed found")]

# Qwen3-4B: 36 layers, hidden 2560, MLP 9728, 32 query heads and 8 KV heads of 128, vocabulary 151,936
QWEN3_4B = ModelShape(params=4_022_468_096, trainable=4_022_468_096, param_bytes=4, trainable_bytes=4, layers=36,
                      hidden=2560, intermediate=9728, q_width=4096, kv_width=1024, vocab=151_936)
JUNIOR = dataclasses.replace(QWEN3_4B, trainable=0, param_bytes=2, trainable_bytes=0)
LORA = dataclasses.replace(QWEN3_4B, trainable=33_030_144, param_bytes=2, trainable_bytes=4)  # r=16, all linear, bf16 base
H100 = 85_520_809_984  # torch.cuda's total_memory of an H100 80GB HBM3 (79.6 GiB)
H200 = 150_110_011_392  # ... of an H200 (139.8 GiB)


def settings(**changes) -> StepSettings:
    """The 4B tandem config's step: 128 rollouts of 1,024 + 3,000 tokens, passes of 4,096 tokens."""
    base = StepSettings(rollout_sequences=128, sequence_tokens=4024, micro_batch_tokens=4096, forward_only_tokens=4 * 4096,
                        rollout_bytes=2, rollout_copy=True, junior_bytes=2, offload_optimizer=True,
                        prefill_tokens=16384, allocator_slack=ALLOCATOR_SLACK)
    return dataclasses.replace(base, **changes)


def test_the_rollout_counts_a_prefill_the_decode_buffers_and_the_slack_hand_computed():
    """One prefill of 16,384 padded positions holds both models' staging K/V (2 x 147,456 bytes a
    position), the larger layer's bf16 temporaries (6*2*2560 + 6(4096+1024) + 2(3*4096 + 2*1024) +
    8*9728 = 167,936 bytes a position), the padding mask (positions x 4,024 x 2 bytes) and its
    128 rows' last logits (bf16 and float32, both models); the decode step 32 bytes per row and
    vocabulary entry per model; the slack 4% of everything but the fixed overhead."""
    pooled = settings(kv_pool_tokens=100_000)
    estimate = estimate_step_memory(LORA, JUNIOR, pooled)
    assert LORA.prefill_bytes_per_token(2) == 167_936
    rollout = estimate.rollout
    assert rollout["prefill caches"] == 16384 * 2 * 147_456
    assert rollout["prefill activations"] == 16384 * 167_936 + 16384 * 4024 * 2
    assert rollout["prefill logits"] == 2 * 128 * 151_936 * 6
    assert rollout["decode buffers"] == 2 * 128 * 151_936 * DECODE_VOCAB_BYTES
    assert rollout["KV caches"] == 100_000 * 2 * 147_456
    rest = sum(v for k, v in rollout.items() if k not in ("overhead", "allocator slack"))
    assert rollout["allocator slack"] == int(0.04 * rest)
    # the H100 run: LoRA, a 100,000-position pool, planned at 60.6 GiB without these parts
    assert 63 * GIB < sum(rollout.values()) < 65 * GIB
    bare = estimate_step_memory(LORA, JUNIOR, dataclasses.replace(pooled, prefill_tokens=None, allocator_slack=0.0))
    assert not {"prefill caches", "prefill activations", "prefill logits", "decode buffers"} & set(bare.rollout)
    assert bare.rollout["allocator slack"] == 0 and bare.update == estimate.update  # the update phase is as before


def test_the_positions_that_fit_leave_room_for_the_slack():
    estimate = estimate_step_memory(LORA, JUNIOR, settings())
    fit = estimate.kv_tokens_that_fit(H100)

    def total(tokens: int) -> int:
        return sum(estimate_step_memory(LORA, JUNIOR, settings(kv_pool_tokens=tokens)).rollout.values())

    assert total(fit) <= H100 < total(fit + 10)


def test_auto_sizes_the_pool_and_the_prefill_from_the_card_and_the_plan():
    unsized = estimate_step_memory(LORA, JUNIOR, settings())  # the pool at the batch's size: 128 x 4,024
    pool, prefill = size_rollout_memory(H100, unsized, 4024, 16384)
    sized = estimate_step_memory(LORA, JUNIOR, settings(kv_pool_tokens=pool, prefill_tokens=prefill))
    rollout = sum(sized.rollout.values())
    assert rollout <= H100 * (1 - CARD_HEADROOM) < rollout + 20 * sized.kv_bytes_per_token  # filled, not more
    weights = sum(v for k, v in sized.rollout.items() if k not in ("KV caches", "prefill caches", "prefill activations",
                                                                  "allocator slack"))
    free = (H100 * (1 - CARD_HEADROOM) - 3 * GIB) / 1.04 - (weights - 3 * GIB)
    per_position = (unsized.rollout["prefill caches"] + unsized.rollout["prefill activations"]) // 16384
    assert prefill == int(PREFILL_SHARE * free) // per_position  # a tenth of what the weights leave
    assert 4024 < prefill < 16384 and 100_000 < pool < 128 * 4024
    # a card with room for the whole batch: the pool stops at what 128 sequences can use, the prefill at its default
    assert size_rollout_memory(3 * H100, unsized, 4024, 16384) == (128 * 4024, 16384)
    assert 300_000 < size_rollout_memory(H200, unsized, 4024, 16384)[0] < 128 * 4024
    # a card that cannot hold one sequence beside the weights
    full = estimate_step_memory(QWEN3_4B, JUNIOR, settings(offload_optimizer=False))
    with pytest.raises(MemoryBudgetError, match="cannot hold one sequence of 4,024 tokens"):
        size_rollout_memory(64 * GIB, full, 4024, 16384)


def test_full_weights_on_one_h100_are_refused_plainly_with_the_lora_variant():
    estimate = estimate_step_memory(QWEN3_4B, JUNIOR, settings(kv_pool_tokens=60_000))
    with pytest.raises(MemoryBudgetError) as err:
        estimate.check(H100, "NVIDIA H100 80GB HBM3")
    message = str(err.value)
    assert "full weights do not fit NVIDIA H100 80GB HBM3 whatever the batch" in message
    assert "two or more GPUs" in message and "configs/rlvr/qwen3_4b_tandem_lora_h100.yaml" in message
    assert "micro_batch_tokens" not in message  # no batch setting makes it fit
    assert (REPO / "configs/rlvr/qwen3_4b_tandem_lora_h100.yaml").is_file()
    # the same step on an H200 fits once the pool is sized: no such statement there
    estimate_step_memory(QWEN3_4B, JUNIOR, settings(kv_pool_tokens=60_000)).check(H200)


@pytest.mark.parametrize("config_file", ["qwen3_4b_tandem_lora_h100.yaml", "qwen35_9b_2b_tandem_lora.yaml"])
def test_the_lora_configs_fit_an_h100_by_the_plan(config_file):
    """The shipped one-GPU LoRA variants, their models built on the meta device at the hub models'
    shapes (benchmarks/train_step.py's SHAPES): the plan with the pool and prefill that
    ``kv_cache_gib: auto`` gives fits an H100."""
    from jsonargparse import ArgumentParser
    from transformers import AutoModelForCausalLM

    import tandem_lit.objectives  # noqa: F401  (short class_path names, as in the CLI)
    import tandem_lit.rollout  # noqa: F401
    from benchmarks.train_step import shape_config
    from tandem_lit.models import apply_lora
    from tandem_lit.training.module import TandemModule

    config = yaml.safe_load((REPO / "configs/rlvr" / config_file).read_text())
    init = dict(config["model"]["init_args"])
    init.pop("verifier")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(TandemModule, "model", skip={"verifier"}, instantiate=False)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    namespace = instantiate(parser.parse_object({"model": init}))
    kwargs = {k: namespace.model[k] for k in namespace.model.keys() if "." not in k and not k.startswith("__")}
    module = TandemModule(verifier=None, **kwargs)
    assert module.engine.kv_cache_gib == "auto" and module.lora.r == 16
    with torch.device("meta"):
        senior = AutoModelForCausalLM.from_config(shape_config(init["senior"]["path"]), dtype=torch.bfloat16)
        module.senior = apply_lora(senior, module.lora)
        module.junior = AutoModelForCausalLM.from_config(shape_config(init["junior"]["path"]), dtype=torch.bfloat16).requires_grad_(False)
    prompts = config["data"]["init_args"]["batch_size"]

    def estimate():
        return estimate_module_memory(module, prompts, mixed_precision=True, decode_dtype=torch.bfloat16)

    line = module.engine.plan_kv_cache(kv_budget(estimate(), H100))  # what fit start does on the card
    assert "kv_cache_gib: auto sized the KV pool" in line and 4024 <= module.engine.kv_cache_tokens < 128 * 4024
    sized = estimate()
    sized.check(H100, "an H100")  # fits: no MemoryBudgetError
    assert sized.rollout["KV caches"] == module.engine.kv_cache_tokens * sized.kv_bytes_per_token
    assert sum(sized.rollout.values()) <= H100 * (1 - CARD_HEADROOM)
    if config_file != "qwen3_4b_tandem_lora_h100.yaml":
        return
    # once fit has put Liger's kernels in the update (as on the H100: it logs them), the plan counts
    # what they save: SwiGLU's activation, 2 x 9,728 bytes a token in each of 36 layers of a 4,096-token pass
    module.updates.fused_kernels = ("rms_norm", "swiglu", "rope", "logprobs")
    assert sized.update["activations"] - estimate().update["activations"] == 4096 * 36 * 2 * 9728


def test_kv_cache_gib_auto_is_a_paged_pool_setting():
    from tandem_lit.rollout.static import FastEngine

    engine = FastEngine(kv_cache="paged", kv_cache_gib="auto")
    assert engine.kv_pool_size() == (None, None)  # not sized yet: counted as the batch's size
    with pytest.raises(ConfigError, match="kv_cache_gib: auto sizes a paged pool"):
        FastEngine(kv_cache_gib="auto")
    with pytest.raises(ConfigError, match="'auto', got 'plan'"):
        FastEngine(kv_cache="paged", kv_cache_gib="plan")


def test_a_refill_holds_one_prefills_staging_caches_at_a_time(monkeypatch):
    """A refill of several prefills (``prefill_tokens`` 1: one row each) copies each one's Hugging
    Face cache into the pool and lets it go before the next: the plan counts one."""
    from tandem_lit.models.tiny import char_tokenizer
    from tandem_lit.rollout.handoff import WordHandoff
    from tandem_lit.rollout.static.plain import StaticDecoderModel
    from tests.test_continuous_batching import JUNIOR_PROMPTS, SAMPLED, SMALL_POOL, paged, queue_batch
    from tests.test_fast_engine import build

    tokenizer = char_tokenizer()
    senior, junior = build("qwen3", len(tokenizer), 64, 2, seed=0), build("llama", len(tokenizer), 32, 1, seed=1)
    alive: list[weakref.ref] = []
    most = [0]
    forward = StaticDecoderModel.prefill_forward

    def tracked(self, input_ids, attention_mask):
        most[0] = max(most[0], sum(ref() is not None for ref in alive))
        logits, cache = forward(self, input_ids, attention_mask)
        alive.append(weakref.ref(cache))
        return logits, cache

    monkeypatch.setattr(StaticDecoderModel, "prefill_forward", tracked)
    engine = paged(senior, junior, tokenizer, prefill_tokens=1, **SMALL_POOL)
    engine.generate(queue_batch(tokenizer, JUNIOR_PROMPTS), WordHandoff(p=0.5), SAMPLED)
    assert len(alive) > 6  # several refills of several one-row prefills, both models
    assert most[0] <= 1  # at most the senior's, while the junior prefills the same rows


def test_an_out_of_memory_names_the_part_of_the_rollout_and_the_setting():
    def raised_in(name: str) -> torch.OutOfMemoryError:
        scope: dict = {}
        exec(f"def {name}():\n    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')", {"torch": torch}, scope)
        try:
            scope[name]()
        except torch.OutOfMemoryError as err:
            return err

    assert out_of_memory.rollout_part(raised_in("prefill_with_cache")) == "rollout prefill"
    assert out_of_memory.rollout_part(raised_in("allocate")) == "rollout KV pool allocation"
    assert out_of_memory.rollout_part(raised_in("decode")) == "rollout decode"
    with pytest.raises(DeviceMemoryError) as err, out_of_memory.phase("update", torch.device("cpu")):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert "in the update" in str(err.value) and "memory.micro_batch_tokens" in str(err.value)
    assert "no checkpoint was written" in str(err.value) and "set memory.gradient_checkpointing: true" in str(err.value)
    # a run that checkpoints already is not told to (the Qwen3.5 LoRA config's update on an H100, 2026-12-07)
    with pytest.raises(DeviceMemoryError) as err, out_of_memory.phase("update", torch.device("cpu"), checkpointing=True):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity ...")
    assert "memory.micro_batch_tokens" in str(err.value) and "gradient_checkpointing" not in str(err.value)
    assert "in the update (a request of 1.50 GiB): " in str(err.value)
    assert "traceback and allocator state" not in str(err.value)  # no trainer, no run folder: no report


def test_the_out_of_memory_report_says_which_tensors_held_the_device():
    """tensor_census: each storage once (a view adds nothing), the run's tensors by role (weights,
    gradients, optimizer state, the rollout copy), the others by shape and dtype, largest first."""
    from types import SimpleNamespace

    senior, copy = torch.nn.Linear(37, 53, dtype=torch.float64), torch.nn.Linear(37, 53, dtype=torch.float16)
    optimizer = torch.optim.AdamW(senior.parameters())
    senior(torch.ones(2, 37, dtype=torch.float64)).sum().backward()
    optimizer.step()
    module = SimpleNamespace(senior=senior, junior=None, reference=None, engine=SimpleNamespace(senior=copy))
    trainer = SimpleNamespace(lightning_module=module, optimizers=[optimizer])
    activation = torch.zeros(41, 43, dtype=torch.float64)
    views = [activation[1:], activation.t()]  # noqa: F841  (alive: the census must not count them again)
    census = out_of_memory.tensor_census(torch.device("cpu"), out_of_memory.known_tensors(trainer), top=1000)
    head, *rows = census.splitlines()
    groups = {}  # label -> (bytes, storages), as the report writes them ("  16112 bytes      2 x  gradients")
    for row in rows:
        size, unit, count, _, label = row.split(maxsplit=4)
        groups[label] = (float(size) if unit == "bytes" else float(size) * 1024**2, int(count))
    weights = (37 * 53 + 53) * 8  # a float64 weight and bias
    assert groups["senior (trained) weights"] == (weights, 2) and groups["gradients"] == (weights, 2)
    assert groups["rollout copy of the senior"] == (weights // 4, 2)
    assert groups["optimizer state"] == (2 * weights + 2 * 4, 6)  # AdamW's two moments and a float32 step per parameter
    assert groups["other (41, 43) float64"] == (41 * 43 * 8, 1)  # the views are the same storage
    assert head.startswith("live tensors on cpu held by Python objects: ")
    sizes = [size for size, _ in groups.values()]
    assert sizes == sorted(sizes, reverse=True)  # largest first


# PyTorch's message, as c10's allocator writes it
FRAGMENTED = ("CUDA out of memory. Tried to allocate {request}. GPU 0 has a total capacity of 79.19 GiB of which "
              "396.00 MiB is free. Including non-PyTorch memory, this process has 78.79 GiB memory in use. Of the "
              "allocated memory 70.12 GiB is allocated by PyTorch, and {idle} is reserved by PyTorch but unallocated. "
              "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
              "to avoid fragmentation.")


@pytest.mark.parametrize(("request_size", "idle", "env", "told"), [
    ("2.00 GiB", "8.27 GiB", "", True),  # room enough, in pieces: fragmentation
    ("2.00 GiB", "1.50 GiB", "", False),  # not enough room either way: lower a setting
    ("104.00 MiB", "1.34 GiB", "", False),  # 1.34 of 71 GiB idle: the card is full, not fragmented (the Qwen3.5 LoRA update, 2026-12-08)
    ("512.00 MiB", "0 bytes", "", False),
    ("2.00 GiB", "8.27 GiB", "expandable_segments:True", False),  # the run sets them already
])
def test_an_out_of_memory_with_room_in_pieces_names_expandable_segments(monkeypatch, request_size, idle, env, told):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", env)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with pytest.raises(DeviceMemoryError) as err, out_of_memory.phase("update", torch.device("cpu"), checkpointing=True):
        raise torch.OutOfMemoryError(FRAGMENTED.format(request=request_size, idle=idle))
    line = str(err.value)
    assert ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line) == told
    assert "memory.micro_batch_tokens" in line  # the setting to lower, either way
    if told:
        assert line.startswith(f"CUDA out of memory in the update (a request of {request_size}): {idle} was reserved "
                               "but unallocated, in pieces too small for the request: start the run with ")


TINY_FIT = ["--config", "configs/gsm8k_tiny.yaml", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0",
            "--model.init_args.evaluation.at_start", "false", "--data.init_args.batch_size", "2",
            "--model.init_args.rollout.sampling.n", "2", "--model.init_args.rollout.sampling.max_new_tokens", "8",
            "--model.init_args.engine", "FastEngine", "--checkpoint.every_n_train_steps", "1"]


@pytest.mark.parametrize("where", ["prefill", "update"])
def test_a_cuda_out_of_memory_in_fit_ends_in_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys, where):
    from tandem_lit.cli import main
    from tandem_lit.rollout.static.plain import StaticDecoderModel
    from tandem_lit.training.update_phase import UpdatePhase

    root = tmp_path / "run"
    main(args=["fit", *TINY_FIT, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "1"])
    last = root / "checkpoints" / "last.ckpt"
    saved = last.read_bytes()

    def out(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    target = (StaticDecoderModel, "prefill_forward") if where == "prefill" else (UpdatePhase, "run")
    monkeypatch.setattr(*target, out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(args=["fit", *TINY_FIT, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2",
                   "--ckpt_path", str(last)])
    assert code.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tandem-lit: error")]
    assert len(lines) == 1
    if where == "prefill":
        assert "CUDA out of memory in the rollout prefill" in lines[0] and "engine.prefill_tokens" in lines[0]
    else:
        assert "CUDA out of memory in the update" in lines[0] and "memory.micro_batch_tokens" in lines[0]
    assert f"resume with --ckpt_path {last}" in lines[0]
    assert last.read_bytes() == saved  # the step cut short wrote nothing over it
    # the request that failed in the line; the traceback beside the run, named by the line
    assert "(a request of 20.00 GiB)" in lines[0] and lines[0].endswith(f"(traceback and allocator state: {root / 'out_of_memory.txt'})")
    report = (root / "out_of_memory.txt").read_text()
    assert report.startswith("CUDA out of memory in the ") and "Traceback" in report and "Tried to allocate 20.00 GiB" in report
