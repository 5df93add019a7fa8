"""VLLMEngine (tandem_lit/rollout/vllm_engine.py).

CPU (CI, where vLLM is never installed): the refusals (no vLLM; a tandem policy), the config path,
and the engine's own logic against a stand-in ``vllm`` module that decodes greedily with
transformers: the Rollout it assembles is HFEngine's, budgets hold per row, weight sync checks
names and shapes, and a level-2 sleep is never decoded without a reload.

GPU (skipped unless CUDA and vLLM are there; run this file in its own process, since vLLM holds
one engine per process and initialises torch.distributed): the real vLLM 0.24 against HFEngine
and FastEngine on a tiny random Qwen3, in float32 so that greedy decoding compares token for token.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import types

import pytest
import torch
from torch import nn

from tandem_lit.errors import ConfigError, MissingDependencyError
from tandem_lit.models.tiny import char_tokenizer
from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import SoloHandoff, TokenHandoff, WordHandoff
from tandem_lit.rollout.record import Author, PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.vllm_engine import VLLMEngine, check_policy
from tandem_lit.rollout.weights import WeightSyncError, rollout_named_tensors
from tests.conftest import teacher_forced

PROMPTS = ["Q: 2+3?\nA:", "Hi", "The quick brown fox jumps over", "1. a\n\n2."]
CONFIG = "configs/rlvr/qwen3_4b_grpo_vllm.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def tiny_qwen3(vocab: int, seed: int = 0) -> nn.Module:
    """A tiny random Qwen3 with head_dim 64 (a size every vLLM attention kernel takes)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=2, pad_token_id=0, bos_token_id=1,
    )
    return Qwen3ForCausalLM(config).eval()


def prompt_batch(tokenizer, device="cpu", prompts=PROMPTS, seed=0) -> PromptBatch:
    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    return PromptBatch(enc.input_ids, enc.attention_mask, sequence_seeds(seed, 0, len(prompts))).to(device)


def with_budgets(prompts: PromptBatch, budgets: list[int]) -> PromptBatch:
    """The batch with per-row budgets (``PromptBatch.max_new_tokens``; set as an attribute so the
    test runs whether or not this checkout's PromptBatch declares the field yet)."""
    prompts = copy.copy(prompts)
    prompts.max_new_tokens = torch.tensor(budgets, device=prompts.seeds.device)
    return prompts


def assert_same_rollouts(expected, got, logprob_atol=1e-4):
    for name in ("completion_ids", "author", "finished", "truncated", "handoffs", "decisions", "junior_draws"):
        assert torch.equal(getattr(expected, name).cpu(), getattr(got, name).cpu()), name
    assert expected.texts == got.texts
    written = expected.completion_mask.cpu()
    torch.testing.assert_close(
        got.senior_logprobs.cpu()[written], expected.senior_logprobs.cpu()[written], atol=logprob_atol, rtol=1e-3
    )


# ------------------------------------------------------------------------------------ refusals


def test_without_vllm_the_engine_says_in_one_line_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, installed or not
    with pytest.raises(MissingDependencyError) as info:
        VLLMEngine()
    message = str(info.value)
    assert "\n" not in message
    assert "pip install 'tandem-lit[vllm]'" in message


@pytest.mark.parametrize("policy", [WordHandoff(p=0.5), TokenHandoff(p=0.1), SoloHandoff("junior")])
def test_a_policy_that_needs_the_junior_is_refused_naming_fast_engine(policy):
    with pytest.raises(ConfigError) as info:
        check_policy(policy)
    assert "FastEngine" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("policy", [SoloHandoff("senior"), WordHandoff(p=0.0)])
def test_policies_where_the_senior_writes_everything_pass(policy):
    check_policy(policy)


def test_bad_settings_are_refused_before_vllm_is_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    for settings in ({"sleep_level": 3}, {"kv_cache_gib": 0.0}, {"gpu_memory_utilization": 1.5}, {"rollout_dtype": "live"}):
        with pytest.raises(ConfigError):
            VLLMEngine(**settings)


# ------------------------------------------------------------------------------- config path


@pytest.mark.usefixtures("in_repo")
def test_the_vllm_grpo_config_parses_with_the_engine(capsys):
    import yaml

    from tandem_lit.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args=["fit", "--config", CONFIG, "--print_config"])
    assert info.value.code == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    assert model["engine"]["class_path"].endswith(".VLLMEngine")
    assert {"sleep_level": 2, "kv_cache_gib": "plan", "max_model_len": 4096}.items() <= model["engine"]["init_args"].items()
    assert model["handoff"] == {"class_path": "tandem_lit.rollout.SoloHandoff", "init_args": {"author": "senior"}}
    assert model["evaluation"]["modes"] == ["senior"]


def test_the_vllm_grpo_config_is_the_grpo_config_with_the_engine_swapped(repo_root):
    import yaml

    plain = yaml.safe_load((repo_root / "configs/rlvr/qwen3_4b_grpo.yaml").read_text())
    swapped = yaml.safe_load((repo_root / CONFIG).read_text())
    engine = swapped["model"]["init_args"].pop("engine")
    assert engine["class_path"] == "VLLMEngine"
    swapped["trainer"]["default_root_dir"] = plain["trainer"]["default_root_dir"]
    assert swapped == plain


# ------------------------------------------------------------- the engine over a stand-in vLLM


class _StandInModel(nn.Module):
    """vLLM's model as ``apply_model`` sees it: ``load_weights`` returns the names it loaded."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.hf = model

    def load_weights(self, weights) -> set[str]:
        params = dict(self.hf.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add("hf." + name)
        return loaded


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


class _StandInLLM:
    """The calls VLLMEngine makes on ``vllm.LLM``, answered by transformers on CPU (greedy only)."""

    def __init__(self, model: str, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.kwargs = kwargs
        self.model = _StandInModel(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).float().eval())
        self.asleep: set[str] = set()
        self.calls: list[str] = []
        self.under_autocast = {"build": _autocast_on()}  # call -> whether any autocast was on during it

    def apply_model(self, fn):
        self.calls.append("apply_model")
        self.under_autocast["apply_model"] = _autocast_on()
        return [fn(self.model)]

    def sleep(self, level: int = 1):
        self.calls.append(f"sleep{level}")
        self.under_autocast["sleep"] = _autocast_on()
        if level == 2:  # its weights are gone: decoding them now would be garbage
            for param in self.model.parameters():
                param.data.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up{tags}")
        self.under_autocast["wake_up"] = _autocast_on()
        self.asleep -= set(tags or self.asleep)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=True):
        assert not self.asleep, "generate on a sleeping engine"
        self.calls.append("generate")
        self.under_autocast["generate"] = _autocast_on()
        outputs = []
        for prompt, p in zip(prompts, params):
            assert p.temperature == 0 and p.logprobs == 0 and not p.detokenize
            ids, written, logprobs = list(prompt["prompt_token_ids"]), [], []
            while len(written) < p.max_tokens:
                logits = self.model.hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
                token = int(logits.argmax())
                written.append(token)
                ids.append(token)
                logprobs.append({token: types.SimpleNamespace(logprob=float(logits.log_softmax(-1)[token]))})
                if not p.ignore_eos and token in p.stop_token_ids:
                    break
            outputs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=written, logprobs=logprobs)]))
        return outputs


@pytest.fixture
def stand_in_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = _StandInLLM
    module.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def engines(senior, tokenizer, **settings):
    reference = HFEngine(rollout_dtype="float32")
    reference.setup(senior, None, tokenizer)
    engine = VLLMEngine(rollout_dtype="float32", **settings)
    engine.setup(senior, None, tokenizer)
    return reference, engine


def test_builds_vllm_from_the_config_with_dummy_weights_and_sleep_mode(stand_in_vllm, tokenizer):
    senior = tiny_qwen3(len(tokenizer))
    _, engine = engines(senior, tokenizer, kv_cache_gib=2.0, enforce_eager=True)
    kwargs = engine.llm.kwargs
    expected = {"load_format": "dummy", "enable_sleep_mode": True, "logprobs_mode": "processed_logprobs",
                "skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32",
                "kv_cache_memory_bytes": 2 << 30}
    assert expected.items() <= kwargs.items() and "gpu_memory_utilization" not in kwargs
    assert "distributed_executor_backend" not in kwargs  # one process: vLLM's own single-worker executor
    assert engine.decodes_copy and next(engine.senior.parameters()).device.type == "meta"
    for name, param in senior.named_parameters():  # the dummy weights were replaced by the senior's
        torch.testing.assert_close(engine.llm.model.hf.get_parameter(name), param)
    assert VLLMEngine().gpu_memory_utilization == 0.3


def test_vllm_is_built_loaded_woken_and_run_outside_the_trainers_autocast(stand_in_vllm, tokenizer):
    """Lightning's bf16-mixed sets the engine up inside training_step's autocast. vLLM built under
    it computed its rotary table with an autocast einsum in bf16 (positions rounded to 8 bits: on the
    H200 a gap to the training forward growing with position, 1.25 nats mean at 3,000 tokens), so
    no vLLM call may run under it: building, loading, sleeping, waking, decoding."""
    senior = tiny_qwen3(len(tokenizer))
    engine = VLLMEngine(rollout_dtype="float32", sleep_level=2)
    prompts, greedy = prompt_batch(tokenizer, "cpu"), SamplingConfig(temperature=0.0, max_new_tokens=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.setup(senior, None, tokenizer)
        engine.generate(prompts, SoloHandoff(), greedy)
        engine.release()
        engine.generate(prompts, SoloHandoff(), greedy)  # wakes, pushes the weights again, decodes
    seen = engine.llm.under_autocast
    assert seen.keys() == {"build", "apply_model", "sleep", "wake_up", "generate"}
    assert not any(seen.values()), seen


def test_greedy_rollouts_are_hf_engines(stand_in_vllm, tokenizer):
    senior = tiny_qwen3(len(tokenizer))
    reference, engine = engines(senior, tokenizer)
    prompts = prompt_batch(tokenizer)
    for policy in (SoloHandoff("senior"), WordHandoff(p=0.0)):
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=20)
        assert_same_rollouts(reference.generate(prompts, policy, greedy), engine.generate(prompts, policy, greedy))
    timing = engine.last_timing()
    assert {"setup_s", "prefill_s", "decode_s", "decode_steps", "prompt_width"} <= timing.as_dict().keys()


def test_rows_end_at_an_end_token_or_their_own_budget(stand_in_vllm, tokenizer):
    senior = tiny_qwen3(len(tokenizer))
    eos = tokenizer.eos_token_id
    with torch.no_grad():  # make the end token likely, so some rows finish inside their budgets
        senior.lm_head.weight[eos] *= 3.0
    _, engine = engines(senior, tokenizer)
    budgets = [3, 17, 8, 1]
    out = engine.generate(with_budgets(prompt_batch(tokenizer), budgets), SoloHandoff(), SamplingConfig(temperature=0.0, max_new_tokens=17))
    lengths = out.lengths.tolist()
    assert all(n <= b for n, b in zip(lengths, budgets))
    ends = out.completion_ids[torch.arange(4), out.lengths - 1]
    assert torch.equal(out.finished, ends == eos) and torch.equal(out.truncated, ~out.finished)
    assert all(n == b for n, b, done in zip(lengths, budgets, out.finished.tolist()) if not done)
    assert (out.author[out.completion_mask] == Author.SENIOR).all() and (out.author[~out.completion_mask] == Author.PAD).all()
    forced = engine.generate(with_budgets(prompt_batch(tokenizer), budgets), SoloHandoff(),
                             SamplingConfig(temperature=0.0, max_new_tokens=17, ignore_eos=True))
    assert forced.lengths.tolist() == budgets and forced.truncated.all()
    with pytest.raises(ValueError, match="1..17"):
        engine.generate(with_budgets(prompt_batch(tokenizer), [3, 18, 8, 1]), SoloHandoff(), SamplingConfig(temperature=0.0, max_new_tokens=17))


def test_a_tandem_policy_is_refused_before_vllm_decodes(stand_in_vllm, tokenizer):
    _, engine = engines(tiny_qwen3(len(tokenizer)), tokenizer)
    with pytest.raises(ConfigError, match="FastEngine"):
        engine.generate(prompt_batch(tokenizer), WordHandoff(p=0.5), SamplingConfig(temperature=0.0))
    assert "generate" not in engine.llm.calls


def test_weight_sync_checks_names_and_shapes(stand_in_vllm, tokenizer):
    senior = tiny_qwen3(len(tokenizer))
    _, engine = engines(senior, tokenizer)
    named = list(rollout_named_tensors(senior))
    with pytest.raises(WeightSyncError, match="unset"):
        engine.load_weights(named[:-1])
    with pytest.raises(WeightSyncError, match="not a parameter"):
        engine.load_weights([*named, ("model.extra.weight", torch.zeros(1))])
    with pytest.raises(WeightSyncError, match="shape"):
        engine.load_weights([(name, t[:1]) if i == 0 else (name, t) for i, (name, t) in enumerate(named)])
    assert engine.load_weights(named) == len(named)


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_release_then_generate_decodes_the_current_weights(stand_in_vllm, tokenizer, sleep_level):
    """Level 2 drops vLLM's weights: with no ``load_weights`` since, the next generate pushes the
    trained senior again (never decodes the dropped ones); after an update, load_weights refills."""
    senior = tiny_qwen3(len(tokenizer))
    reference, engine = engines(senior, tokenizer, sleep_level=sleep_level)
    prompts, greedy = prompt_batch(tokenizer), SamplingConfig(temperature=0.0, max_new_tokens=16)
    before = engine.generate(prompts, SoloHandoff(), greedy)
    engine.release()
    assert_same_rollouts(before, engine.generate(prompts, SoloHandoff(), greedy))
    engine.release()
    with torch.no_grad():
        for param in senior.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    engine.load_weights(rollout_named_tensors(senior))
    after = engine.generate(prompts, SoloHandoff(), greedy)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert_same_rollouts(reference.generate(prompts, SoloHandoff(), greedy), after)
    assert engine.llm.calls.count(f"sleep{sleep_level}") == 2


# ----------------------------------------------------------------------------- real vLLM, GPU

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


def gpu(test):
    """A test of the real vLLM: on a GPU machine (the ``gpu`` marker), with vLLM installed."""
    return pytest.mark.gpu(needs_vllm(test))
# vLLM's float32 attention (its Triton kernel) takes dot products in TF32: scores differ from the
# transformers forward by ~1e-3 relative, so a greedy near-tie may break the other way
NEAR_TIE = 2e-3


@pytest.fixture(scope="module")
def gpu_setup(tokenizer):
    """One real VLLMEngine for the module (vLLM holds one engine per process), float32 so that
    greedy decoding compares with the transformers forward."""
    senior = tiny_qwen3(len(tokenizer)).cuda()
    # colocated as in training: a model's worth of the card is taken before vLLM starts (vLLM's
    # default start check wants 92% of the card free, which beside a training model never is)
    training_model = torch.empty(int(0.2 * torch.cuda.mem_get_info()[1]), dtype=torch.uint8, device="cuda")
    engine = VLLMEngine(rollout_dtype="float32", kv_cache_gib=2.0, max_model_len=512, enforce_eager=True, sleep_level=2)
    engine.setup(senior, None, tokenizer)
    del training_model
    reference = HFEngine(rollout_dtype="float32")  # decodes the float32 senior in place: follows its updates
    reference.setup(senior, None, tokenizer)
    return senior, engine, reference


@gpu
def test_gpu_a_kv_cache_larger_than_the_free_memory_is_one_line(gpu_setup, tokenizer):
    senior, _, _ = gpu_setup
    too_big = torch.cuda.mem_get_info()[1] / (1 << 30)  # the whole card
    with pytest.raises(ConfigError, match=r"kv_cache_gib=\S+ does not fit: .* lower kv_cache_gib"):
        VLLMEngine(kv_cache_gib=too_big).setup(senior, None, tokenizer)


def assert_greedy_of(senior, rollout, logprob_atol: float = NEAR_TIE):
    """Every written token is the senior's argmax (up to a near-tie), with the senior's log-prob."""
    chosen, best = teacher_forced(senior, rollout)
    written = rollout.completion_mask
    assert (chosen[written] >= best[written] - NEAR_TIE).all(), "vLLM wrote a token the senior does not rank first"
    torch.testing.assert_close(rollout.senior_logprobs[written], chosen[written], atol=logprob_atol, rtol=1e-3)


def assert_same_greedy(expected, got, senior, logprob_atol: float = NEAR_TIE):
    """``got`` is vLLM's greedy rollout of ``senior``; equal to ``expected`` (another engine's) token
    for token unless a near-tie broke the other way (then the rows part there, and are reported)."""
    assert_greedy_of(senior, got, logprob_atol)
    if torch.equal(expected.completion_ids.cpu(), got.completion_ids.cpu()):
        assert_same_rollouts(expected, got, logprob_atol=logprob_atol)
    else:
        same = (expected.completion_ids.cpu() == got.completion_ids.cpu()).all(-1).tolist()
        print(f"rows equal to the other engine's: {same} (the others part at a near-tie)")


@gpu
def test_gpu_greedy_rollouts_are_the_seniors_as_hf_and_fast_engine_decode_them(gpu_setup, tokenizer):
    from tandem_lit.rollout.static import FastEngine

    senior, engine, reference = gpu_setup
    prompts, greedy = prompt_batch(tokenizer, "cuda"), SamplingConfig(temperature=0.0, max_new_tokens=32)
    got = engine.generate(prompts, SoloHandoff(), greedy)
    assert_same_greedy(reference.generate(prompts, SoloHandoff(), greedy), got, senior)
    fast = FastEngine(kernels="torch", rollout_dtype="float32")
    fast.setup(senior, None, tokenizer)
    assert_same_greedy(fast.generate(prompts, SoloHandoff(), greedy), got, senior)
    print("vllm timing", engine.last_timing())


@gpu
def test_gpu_sampled_logprobs_are_the_seniors_at_the_temperature(gpu_setup, tokenizer):
    senior, engine, _ = gpu_setup
    prompts, sampling = prompt_batch(tokenizer, "cuda", seed=3), SamplingConfig(temperature=0.7, max_new_tokens=24)
    out = engine.generate(prompts, SoloHandoff(), sampling)
    expected, _ = teacher_forced(senior, out, sampling.temperature)
    written = out.completion_mask
    torch.testing.assert_close(out.senior_logprobs[written], expected[written], atol=NEAR_TIE, rtol=1e-3)
    # a seed gives its rollout whatever the batch around it
    reordered = PromptBatch(prompts.input_ids.flip(0), prompts.attention_mask.flip(0), prompts.seeds.flip(0))
    assert engine.generate(reordered, SoloHandoff(), sampling).texts == out.texts[::-1]


@gpu
def test_gpu_per_row_budgets(gpu_setup, tokenizer):
    _, engine, _ = gpu_setup
    budgets = [5, 40, 1, 23]
    out = engine.generate(with_budgets(prompt_batch(tokenizer, "cuda"), budgets), SoloHandoff(),
                          SamplingConfig(temperature=0.7, max_new_tokens=40, ignore_eos=True))
    assert out.lengths.tolist() == budgets and out.truncated.all() and not out.finished.any()
    # rows leaving the batch at different steps keep each token's own log-prob (the training
    # step's lognormal budgets measured a 1.25-nat gap that equal budgets did not: issue 25)
    expected, _ = teacher_forced(gpu_setup[0], out, 0.7)
    written = out.completion_mask
    torch.testing.assert_close(out.senior_logprobs[written], expected[written], atol=NEAR_TIE, rtol=1e-3)


@gpu
def test_gpu_decoding_ignores_the_trainers_autocast(gpu_setup, tokenizer):
    """training_step runs under Lightning's bf16 autocast: vLLM's float32 forward must not round to
    bf16 under it (its eager matmuls would)."""
    senior, engine, _ = gpu_setup
    prompts, sampling = prompt_batch(tokenizer, "cuda", seed=5), SamplingConfig(temperature=0.7, max_new_tokens=24)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = engine.generate(prompts, SoloHandoff(), sampling)
    expected, _ = teacher_forced(senior, out, sampling.temperature)
    written = out.completion_mask
    torch.testing.assert_close(out.senior_logprobs[written], expected[written], atol=NEAR_TIE, rtol=1e-3)


@gpu
def test_gpu_release_frees_memory_and_new_weights_are_decoded(gpu_setup, tokenizer):
    """TRL issue 5312's regression test: after an update and load_weights, vLLM decodes the new
    weights (not the dummy or the old ones), across a sleep of either level."""
    senior, engine, reference = gpu_setup
    prompts, greedy = prompt_batch(tokenizer, "cuda"), SamplingConfig(temperature=0.0, max_new_tokens=32)
    before = engine.generate(prompts, SoloHandoff(), greedy)
    for level in (2, 1):
        engine.sleep_level = level
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        engine.release()
        freed = torch.cuda.mem_get_info()[0] - free_awake
        print(f"sleep level {level}: freed {freed / 2**30:.2f} GiB")
        assert freed > 1.5 * 2**30  # at least most of the 2 GiB KV cache
        assert_same_rollouts(before, engine.generate(prompts, SoloHandoff(), greedy), logprob_atol=1e-5)
    engine.release()
    with torch.no_grad():
        for param in senior.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    engine.load_weights(rollout_named_tensors(senior))
    after = engine.generate(prompts, SoloHandoff(), greedy)
    assert not torch.equal(before.completion_ids, after.completion_ids), "the update should change greedy output"
    # weights moved by 0.5 per entry give logits some tens of nats wide, where vLLM's TF32
    # attention is off by up to ~0.012 nats (H200, 2026-12-02): tokens must still be the argmax
    assert_same_greedy(reference.generate(prompts, SoloHandoff(), greedy), after, senior, logprob_atol=0.05)
    engine.load_weights(rollout_named_tensors(senior))  # awake this time: the prefix cache is reset
    assert_same_rollouts(after, engine.generate(prompts, SoloHandoff(), greedy), logprob_atol=1e-5)


def test_kv_cache_plan_is_the_memory_plans_kv_line(stand_in_vllm):
    """``kv_cache_gib: plan``: vLLM's KV cache is what the training run's memory plan gives the
    rollout phase's KV caches (rollout.batch_size sequences of prompt + completion caps)."""
    from conftest import tiny_tandem_module

    from tandem_lit.objectives import GRPO
    from tandem_lit.verifiers import GSM8KVerifier

    module = tiny_tandem_module(
        verifier=GSM8KVerifier(), objective=GRPO(), junior=None, handoff=SoloHandoff("senior"), rollout_batch_size=8, max_prompt_tokens=64,
        sampling=SamplingConfig(temperature=0.0, max_new_tokens=32, n=2),
        engine=VLLMEngine(kv_cache_gib="plan", rollout_dtype="float32"),
    )
    from tandem_lit.training.memory import kv_budget

    module.configure_model()
    planned = module.memory_estimate().rollout["KV caches"]
    module.rollouts.plan_kv_cache(kv_budget(module.memory_estimate(), None))  # as fit starts on a GPU
    engine = module.rollouts.ready()
    # min(rollout.batch_size 8, 1 prompt (no data module) x n 2) = 2 sequences x (64 + 32) tokens
    # x the tiny senior's K and V per token, float32
    assert planned == 2 * (64 + 32) * module.engine.senior.config.num_hidden_layers * 2 * 4 * (
        module.engine.senior.config.num_key_value_heads * module.engine.senior.config.head_dim)
    assert engine.llm.kwargs["kv_cache_memory_bytes"] == planned


def test_kv_cache_plan_outside_a_training_run_is_one_line(stand_in_vllm, tokenizer):
    with pytest.raises(ConfigError, match="kv_cache_gib: plan sizes the KV cache from a training run's memory plan"):
        VLLMEngine(kv_cache_gib="plan", rollout_dtype="float32").setup(tiny_qwen3(len(tokenizer)), None, tokenizer)


def test_the_memory_plan_counts_a_kv_cache_given_in_gib_at_that_size(stand_in_vllm):
    assert VLLMEngine(kv_cache_gib=2.5).kv_pool_size() == (None, 2.5)
    assert VLLMEngine(kv_cache_gib="plan").kv_pool_size() == (None, None)  # the plan's own number
    assert VLLMEngine().kv_pool_size() == (None, None)  # gpu_memory_utilization: the batch's estimate


@gpu
def test_gpu_with_cuda_graphs_rows_of_different_budgets_keep_their_logprobs(repo_root):
    """tests/vllm_graphs_check.py in a process of its own (vLLM holds one engine per process, and
    this module's is eager): graphs and torch.compile on, rows finishing at different steps."""
    import subprocess

    done = subprocess.run([sys.executable, str(repo_root / "tests" / "vllm_graphs_check.py")],
                          capture_output=True, text=True, timeout=600)
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vllm graphs ok" in done.stdout
