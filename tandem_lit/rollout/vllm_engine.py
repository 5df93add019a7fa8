"""VLLMEngine: solo rollouts from vLLM, colocated in the training process.

For the runs where one model writes everything (the plain-GRPO arm, solo evaluation, solo pass@k
with a large n, solo training of an architecture FastEngine lacks), vLLM's paged, continuously
batched decoding is the fastest engine we have on long-tailed lengths (../shared/vllm/README.md).
Tandem policies need both models in one step, which vLLM has no place for: FastEngine runs those.

How it sits in training (DESIGN.md, decisions 4 and 10):

- In process, no server: ``vllm.LLM`` with its engine core in this process, one per training
  rank (``external_launcher`` when torch.distributed runs several ranks: each rank decodes its own
  prompts from its own copy, as verl and TRL's colocate mode do).
- No checkpoint on disk: the senior's config goes to a temporary folder, vLLM builds the
  architecture with dummy weights, and ``load_weights`` fills them from the seam every engine
  shares (``rollout_named_tensors``: cast, LoRA merged, QLoRA dequantised, FSDP gathered), in
  Hugging Face names; vLLM's own ``load_weights`` maps them (q/k/v and gate/up stacking). Never a
  reload without tensors: that reads the dummy weights back, silently (TRL issue 5312).
- Memory: ``release`` puts vLLM to sleep (its KV cache freed; level 1 keeps the weights on the
  host, level 2 drops them), so the update gets the memory; the next ``load_weights`` or
  ``generate`` wakes it. After a level-2 sleep with no ``load_weights`` since, the trained senior
  is pushed again before decoding: the engine never decodes discarded weights.
- The returned Rollout is every engine's: token ids from the (unpadded) prompt ids, one seed per
  sequence, the senior's log-prob of each token after temperature (vLLM's processed log-probs).
  vLLM draws with its own per-request generators, so a seed gives the same rollout in every vLLM
  run, not the same rollout as FastEngine; greedy rollouts are the same in both.

vLLM is an optional extra (``pip install 'tandem-lit[vllm]'``, vLLM 0.24.0: torch 2.11 and CUDA
13); this module imports it only when an engine is built.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import tempfile
import time
from typing import Any, Literal

import torch
from torch import nn

from tandem_lit.errors import ConfigError, MissingDependencyError
from tandem_lit.rollout.engine import EngineTiming, KVBudget, RolloutEngine
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.rollout.record import Author, PromptBatch, Rollout
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.weights import (
    WeightSyncError,
    check_rollout_dtype,
    expected_parameter,
    gathered,
    plain_model,
    rollout_dtype,
    rollout_named_tensors,
    unwrapped_class,
)

INSTALL_HINT = "pip install 'tandem-lit[vllm]'"
GIB = 1 << 30
START_MARGIN_GIB = 4  # vLLM's activations, sampler and CUDA graphs beside its KV cache and weights


def import_vllm():
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise MissingDependencyError(
            f"VLLMEngine needs vLLM 0.24.0, which is not installed ({err}); install it with: {INSTALL_HINT}"
        ) from err


def check_policy(policy: HandoffPolicy) -> None:
    """vLLM decodes one model: only policies where the senior writes every token."""
    if policy.only_author != Author.SENIOR:
        raise ConfigError(
            f"VLLMEngine decodes the senior alone, and {policy!r} needs the junior: use FastEngine for tandem rollouts"
        )


def architecture_on_meta(trained: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The plain model of ``trained``'s architecture in ``dtype``, without storage: the names and
    shapes a weight producer must cover (its weights live in vLLM)."""
    base = plain_model(trained)
    with torch.device("meta"):
        shape = unwrapped_class(base)._from_config(base.config, dtype=dtype)
    shape.generation_config = base.generation_config
    return shape.eval().requires_grad_(False)


def row_budgets(prompts: PromptBatch, limit: int) -> list[int]:
    """Each row's token budget: ``prompts.max_new_tokens`` when the batch carries one, else ``limit``."""
    budgets = getattr(prompts, "max_new_tokens", None)
    if budgets is None:
        return [limit] * prompts.batch_size
    budgets = [int(b) for b in budgets.tolist()]
    if budgets and not (1 <= min(budgets) and max(budgets) <= limit):
        raise ValueError(
            f"PromptBatch.max_new_tokens must lie in 1..{limit} (sampling.max_new_tokens), got {min(budgets)}..{max(budgets)}"
        )
    return budgets


def start_utilization(kv_cache_gib: float, weight_bytes: int, device: torch.device) -> float:
    """vLLM's ``gpu_memory_utilization`` when its KV cache is given in GiB.

    The KV cache is then ``kv_cache_memory_bytes`` and the utilization only gates the start: vLLM
    refuses to start unless that share of the whole card is free, and beside the training model
    (colocated) its default 0.92 never is. So ask for what is free now, after checking, in one
    line, that the KV cache and vLLM's weights fit in it (with ``START_MARGIN_GIB`` for its
    activations and graphs).
    """
    free, total = torch.cuda.mem_get_info(device)
    needed = kv_cache_gib * GIB + weight_bytes + START_MARGIN_GIB * GIB
    if free < needed:
        raise ConfigError(
            f"VLLMEngine kv_cache_gib={kv_cache_gib:g} does not fit: {free / GIB:.1f} GiB of the GPU are free beside "
            f"the training model, and vLLM needs {needed / GIB:.1f} (KV cache + {weight_bytes / GIB:.1f} GiB of weights "
            f"+ {START_MARGIN_GIB} for activations): lower kv_cache_gib"
        )
    return (free - GIB // 2) / total


@contextlib.contextmanager
def outside_autocast():
    """Where vLLM runs, is built, loads and wakes: never under the trainer's autocast.
    Lightning's bf16-mixed wraps ``training_step`` (and so the rollout phase, where the engine is
    first set up) in ``torch.autocast``, which vLLM does not expect: built under it, vLLM computed
    its rotary cos/sin table with an autocast einsum, in bf16, so position p was rotated as if at p
    rounded to 8 significant bits (3,000 as 3,008): a gap to the training forward that grew with
    the position, 1.25 nats on average at 3,000-token rollouts (issue 25). FastEngine turns
    autocast off the same way. Also a decorator."""
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        yield


class VLLMEngine(RolloutEngine):
    """Solo senior rollouts from an in-process vLLM 0.24 (``pip install 'tandem-lit[vllm]'``).

    Args:
        sleep_level: What ``release`` frees: 2 (default) drops the KV cache and the weights (the
            next ``load_weights``, which follows every update anyway, refills them; no host copy),
            1 drops the KV cache and moves the weights to host memory (the next wake copies them
            back). Both free the same memory; level 1's copy to the host makes it much slower to fall
            asleep (docs/vllm.md).
        kv_cache_gib: vLLM's KV cache in GiB; ``plan``: what the training memory plan gives the
            rollout phase's KV caches (``rollout.batch_size`` sequences of ``max_prompt_tokens`` +
            ``max_new_tokens``: every sequence running at once can reach its cap), checked against
            the card with the rest of the step before the first rollout. None: sized by
            ``gpu_memory_utilization``.
        gpu_memory_utilization: Share of the GPU's memory vLLM may hold (weights, activations and
            KV cache) when ``kv_cache_gib`` is None. The training model is beside it: keep it low.
        enforce_eager: No CUDA graphs and no torch.compile (faster start, slower decoding).
        max_model_len: Longest prompt + completion, in tokens (None: the model's context length;
            a shorter one lets a small KV cache hold at least one full sequence).
        rollout_dtype: Dtype vLLM decodes in: ``auto`` (bf16 on a GPU that has it), ``bfloat16``,
            ``float16`` or ``float32``. Never ``live``: vLLM always holds its own copy.
        engine_kwargs: Further ``vllm.LLM`` arguments (e.g. ``max_num_seqs``), passed as they are.
    """

    queues_rows = True  # vLLM's scheduler admits requests as its KV cache allows (``max_batch`` unused)

    def sampled_vocab(self, tokenizer) -> None:
        """vLLM samples and scores over every logit of the model's vocabulary (config.vocab_size)."""
        return None

    def __init__(
        self,
        sleep_level: int = 2,
        kv_cache_gib: float | Literal["plan"] | None = None,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        rollout_dtype: str = "auto",
        engine_kwargs: dict[str, Any] | None = None,
    ):
        if sleep_level not in (1, 2):
            raise ConfigError(f"VLLMEngine sleep_level must be 1 (weights to host memory) or 2 (weights dropped), got {sleep_level}")
        if kv_cache_gib not in (None, "plan") and not (isinstance(kv_cache_gib, (int, float)) and kv_cache_gib > 0):
            raise ConfigError(f"VLLMEngine kv_cache_gib must be > 0 GiB, 'plan' or None, got {kv_cache_gib!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"VLLMEngine gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if check_rollout_dtype(rollout_dtype) == "live":
            raise ConfigError("VLLMEngine decodes its own copy of the senior inside vLLM: rollout_dtype 'live' is not possible")
        self.vllm = import_vllm()
        self.sleep_level = sleep_level
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.max_model_len = max_model_len
        self.rollout_dtype = rollout_dtype
        self.engine_kwargs = dict(engine_kwargs or {})
        self.llm = None
        self._config_folder: tempfile.TemporaryDirectory | None = None
        self._built_config: dict | None = None
        self._asleep: set[str] = set()  # vLLM memory tags now released: "weights", "kv_cache"
        self._weights_lost = False  # a level-2 sleep dropped them and nothing has been loaded since
        self._last_timing: EngineTiming | None = None
        self.planned_kv_bytes: int | None = None

    check_policy = staticmethod(check_policy)

    def kv_pool_size(self) -> tuple[int | None, float | None]:
        # a size in GiB is vLLM's cache whatever the batch; "plan" takes the plan's own number
        return None, (float(self.kv_cache_gib) if isinstance(self.kv_cache_gib, (int, float)) else None)

    def plan_kv_cache(self, budget: KVBudget) -> str | None:
        """``kv_cache_gib: plan``: vLLM's KV cache is the plan's KV bytes."""
        if self.kv_cache_gib == "plan":
            self.planned_kv_bytes = int(budget.planned_bytes)
        return None

    # ------------------------------------------------------------------------------ weights

    @outside_autocast()
    def bind_senior(self, trained: nn.Module) -> None:
        """Build vLLM for ``trained``'s architecture (once per process) and load its weights."""
        self.trained_senior = trained
        dtype = rollout_dtype(self.rollout_dtype, trained)
        self.senior = architecture_on_meta(trained, dtype)
        self.device = next(plain_model(trained).parameters()).device
        if self.llm is None:
            self.llm = self._build(plain_model(trained).config, dtype)
        elif self._built_config != self._config_dict(plain_model(trained).config, dtype):
            raise ConfigError(
                "VLLMEngine holds one vLLM per process, built for another architecture or dtype; "
                "use a new process (or FastEngine) for a second model"
            )
        self.load_weights(rollout_named_tensors(trained))
        self.weights_version = 0

    @property
    def decodes_copy(self) -> bool:
        return True  # always vLLM's own copy

    @outside_autocast()
    def load_weights(self, named_tensors) -> int:
        """Copy (name, tensor) pairs in the plain model's names into vLLM's model, in place; they
        must cover the model exactly. Wakes the weights first if ``release`` put them to sleep."""
        if "weights" in self._asleep:
            torch.cuda.empty_cache()  # hand PyTorch's cached blocks back before vLLM maps its own
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        checked = _Checked(self.senior, named_tensors)
        loaded = self.llm.apply_model(lambda model: _load_into(model, checked))
        checked.check_complete()
        for not_loaded in loaded:
            if not_loaded:
                raise WeightSyncError(
                    f"weight sync: vLLM's model kept {len(not_loaded)} parameters unloaded (e.g. {sorted(not_loaded)[:3]}); "
                    "the names do not map onto vLLM's architecture"
                )
        self._weights_lost = False
        if not self._asleep:
            self.llm.reset_prefix_cache()  # cached prompt blocks were computed with the old weights
        self.weights_version += 1
        return checked.count

    # ------------------------------------------------------------------------------ memory

    @outside_autocast()
    def release(self) -> None:
        """Put vLLM to sleep (``sleep_level``), so a training update can use its memory."""
        if self.llm is None or self._asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_lost = self.sleep_level == 2
        torch.cuda.empty_cache()

    @outside_autocast()
    def wake_up(self) -> None:
        """Map vLLM's memory back (weights first; the trained senior's pushed again if a level-2
        sleep dropped them), then the KV cache."""
        if not self._asleep:
            return
        if self._weights_lost:
            with gathered(self.trained_senior):  # (a collective under FSDP: every rank wakes here)
                self.load_weights(rollout_named_tensors(self.trained_senior))
        elif "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep.clear()

    # ------------------------------------------------------------------------------ decoding

    def generate(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig) -> Rollout:
        self.check_policy(policy)
        started = time.perf_counter()
        self.wake_up()
        woken = time.perf_counter()
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.input_ids.cpu(), prompts.attention_mask.cpu())]
        budgets = row_budgets(prompts, sampling.max_new_tokens)
        params = [self._params(sampling, seed, budget) for seed, budget in zip(prompts.seeds.tolist(), budgets)]
        with outside_autocast():
            outputs = self.llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
        decoded = time.perf_counter()
        rollout = self._rollout(prompts, policy, sampling, [out.outputs[0] for out in outputs])
        self._last_timing = EngineTiming(
            setup_s=woken - started,
            prefill_s=0.0,  # vLLM interleaves prefill with decoding: both are in decode_s
            decode_s=decoded - woken,
            decode_steps=int(rollout.lengths.max()) if rollout.lengths.numel() else 0,
            prompt_width=prompts.input_ids.shape[1],
        )
        return rollout

    def last_timing(self) -> EngineTiming:
        """The last ``generate``: waking and reloading (setup_s), vLLM's generate call (decode_s,
        prefill included), the longest completion (decode_steps) and the padded prompt width."""
        if self._last_timing is None:
            raise RuntimeError("last_timing() reports on a generate() call; none has run yet")
        return self._last_timing

    def _params(self, sampling: SamplingConfig, seed: int, budget: int):
        return self.vllm.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=int(seed),
            max_tokens=budget,
            ignore_eos=sampling.ignore_eos,
            stop_token_ids=[] if sampling.ignore_eos else list(self.eos_token_ids),
            logprobs=0,  # the sampled token's own log-prob only
            detokenize=False,  # texts are decoded below, by the tokenizer every engine uses
        )

    def _rollout(self, prompts: PromptBatch, policy: HandoffPolicy, sampling: SamplingConfig, completions) -> Rollout:
        tokens = [list(c.token_ids) for c in completions]
        batch = len(tokens)
        width = max([len(t) for t in tokens] + [1])
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        author = torch.full((batch, width), int(Author.PAD), dtype=torch.int8)
        logprobs = torch.zeros((batch, width), dtype=torch.float32)
        ended = torch.zeros(batch, dtype=torch.bool)
        eos = set(self.eos_token_ids)
        for row, (written, completion) in enumerate(zip(tokens, completions)):
            n = len(written)
            ids[row, :n] = torch.tensor(written, dtype=torch.long)
            author[row, :n] = int(Author.SENIOR)
            logprobs[row, :n] = torch.tensor(
                [position[token].logprob for position, token in zip(completion.logprobs, written)], dtype=torch.float32
            )
            ended[row] = n > 0 and not sampling.ignore_eos and written[-1] in eos
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        zeros = torch.zeros(batch, dtype=torch.long)
        device = prompts.input_ids.device
        return Rollout(
            prompt_ids=prompts.input_ids,
            prompt_mask=prompts.attention_mask,
            completion_ids=ids.to(device),
            author=author.to(device),
            finished=ended.to(device),
            truncated=(~ended).to(device),
            handoffs=zeros.to(device),
            # as TandemDecoder counts them: a policy that draws its first author draws once (p=0: the senior)
            decisions=torch.full_like(zeros, int(policy.first_author == "draw")).to(device),
            junior_draws=zeros.to(device),
            texts=texts,
            senior_logprobs=logprobs.to(device),
        )

    # ------------------------------------------------------------------------------ building

    @staticmethod
    def _config_dict(config, dtype: torch.dtype) -> dict:
        return dict(config.to_diff_dict(), rollout_dtype=str(dtype))

    def _build(self, config, dtype: torch.dtype):
        """vLLM's LLM for this config, with dummy weights (``load_weights`` fills them)."""
        self._config_folder = tempfile.TemporaryDirectory(prefix="tandem-vllm-")
        config = copy.deepcopy(config)  # the trained model's stays as it is
        config.architectures = [unwrapped_class(plain_model(self.trained_senior)).__name__]  # vLLM picks its class by this
        config.save_pretrained(self._config_folder.name)
        self._built_config = self._config_dict(plain_model(self.trained_senior).config, dtype)
        # the engine core in this process: weights are pushed by reference, never pickled
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: dict[str, Any] = dict(
            model=self._config_folder.name,
            skip_tokenizer_init=True,  # token ids in and out; texts come from our tokenizer
            load_format="dummy",
            dtype=str(dtype).removeprefix("torch."),
            enable_sleep_mode=True,
            enforce_eager=self.enforce_eager,
            logprobs_mode="processed_logprobs",  # after temperature, as every engine reports them
            seed=0,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.kv_cache_gib is not None:
            kv_gib = self.kv_cache_gib
            if kv_gib == "plan":
                if self.planned_kv_bytes is None:
                    raise ConfigError("VLLMEngine kv_cache_gib: plan sizes the KV cache from a training run's memory "
                                      "plan, and this engine was set up outside one: give kv_cache_gib in GiB")
                kv_gib = self.planned_kv_bytes / GIB
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * GIB)
            if self.device.type == "cuda":
                weights = sum(p.numel() for p in plain_model(self.trained_senior).parameters()) * dtype.itemsize
                kwargs["gpu_memory_utilization"] = start_utilization(kv_gib, weights, self.device)
        else:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # one engine per training rank, each decoding its own prompts (no tensor parallelism);
            # vLLM joins the process group that is already there
            kwargs["distributed_executor_backend"] = "external_launcher"
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", str(self.device.index or 0))
        precision = torch.get_float32_matmul_precision()
        try:
            return self.vllm.LLM(**(kwargs | self.engine_kwargs))
        finally:  # vLLM's worker sets the process-wide float32 matmul precision: the training's stays
            torch.set_float32_matmul_precision(precision)


class _Checked:
    """The producer's (name, tensor) pairs, checked against the architecture's names and shapes
    as they stream into vLLM, and cast to its dtype one tensor at a time."""

    def __init__(self, shape: nn.Module, named_tensors):
        self.expected = {name: p for name, p in shape.named_parameters()}
        self.named_tensors = named_tensors
        self.seen: set[str] = set()
        self.count = 0

    def __iter__(self):
        for name, tensor in self.named_tensors:
            param = expected_parameter(self.expected, name, tensor, "the senior's architecture")
            self.seen.add(name)
            self.count += 1
            yield name, tensor.to(param.dtype)

    def check_complete(self) -> None:
        missing = sorted(self.expected.keys() - self.seen)
        if missing:
            raise WeightSyncError(f"weight sync left {len(missing)} senior parameters unset (e.g. {missing[:3]})")


def _load_into(model: nn.Module, named: _Checked) -> set[str]:
    """Inside vLLM's worker: load the pairs, return the names of vLLM parameters left unloaded."""
    loaded = model.load_weights(iter(named))
    if loaded is None:  # a model whose load_weights does not report: nothing to check against
        return set()
    return {name for name, _ in model.named_parameters()} - set(loaded)

