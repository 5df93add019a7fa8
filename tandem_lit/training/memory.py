"""GPU memory of a training step: an estimate from shapes before the run.

A step has two phases that never need their big buffers at the same time:

    rollout: trained weights + rollout copy + junior + KV caches (+ optimizer state unless offloaded)
    update:  trained weights + gradients + optimizer state + rollout copy + junior + activations

The engine releases its caches before the update and gradients are freed (not zeroed) after it,
so the peak is the larger phase, not their sum. ``estimate_step_memory`` adds the parts up from
the models' shapes and the run's settings; ``MemoryEstimate.check`` fails before the first step
with what does not fit and which setting to change, instead of an out-of-memory trace mid-run.
With a paged engine the KV caches are its pool, which the engine sizes from ``kv_budget`` (a pool
the run left unsized gets what fits). On W ranks (FSDP2, ``StepSettings.world``) the senior's float32 weights,
gradients and optimizer state are split W ways; every rank still holds the full bf16 rollout
copy, the junior, the KV caches of its own share of the rollouts and the activations of its
micro-batches, plus the layers FSDP gathers for compute (the root unit, embeddings and head,
stays gathered from forward to backward; one or two decoder layers at a time). A third moment
counts then: the weight sync before the rollouts gathers the whole senior at once
(``weights.gathered``) next to the rollout copy. The activation model is deliberately simple
(saved tensors of a Llama-family block under bf16 autocast, counted per token; a hybrid model's
layers weighted by what they were measured to save, ``HYBRID_LAYER_FACTORS``; less what Liger's
SwiGLU does not save, when the update runs it); ``benchmarks/train_step.py`` prints it next to the
measured peak and ``dev/benchmarks/activation_bytes.py`` measures a layer's saved bytes against it.

The rollout phase of an engine that prefills into staging caches and copies them into its own
(FastEngine: ``StepSettings.prefill_tokens``) also counts what one prefill holds beside the pool:
both models' K/V of its padded positions (the Hugging Face cache it copies from), one layer's
forward temporaries over those positions and the padding mask, the last position's logits of its
rows; the decode step's per-row buffers, CUDA graphs and sampling temporaries over the vocabulary;
and the caching allocator's slack (``ALLOCATOR_SLACK`` of the phase's memory). The prefill reads
the rollout copy of the senior (bf16) when the engine decodes a copy, so its temporaries are in
the rollout dtype. ``size_rollout_memory`` sizes the pool and the prefill from a card's memory and
this plan (``kv_cache_gib: auto``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem_lit.errors import MemoryBudgetError
from tandem_lit.rollout.engine import KVBudget

log = logging.getLogger(__name__)

GIB = 1024**3
FIXED_OVERHEAD = 3 * GIB  # CUDA context, cuBLAS workspaces, graph pools, allocator slack
LOGIT_CHUNK_BYTES = 3 * GIB  # logprobs.CHUNK_ELEMENTS float32 logits, their log-softmax and its gradient
# What a hybrid model's layers save per token over the Llama-block model below, as measured by
# dev/benchmarks/activation_bytes.py (bf16 autocast, Qwen3.5-9B shapes, the Gated DeltaNet layer
# under transformers' torch fallback), each the larger of the full-weight and LoRA ratios: an
# estimate that errs low lets a step run out of memory mid-run, as the 9B did (dev/log.md).
HYBRID_LAYER_FACTORS = {"linear_attention": 3.0, "full_attention": 1.5}
# Bytes per row and vocabulary entry of the decode step beside its graphs: each model's float32
# logits buffer and the graph's own logits, the sampling's top-k/top-p sort (values and int64
# indices), probabilities and their cumulative sum.
DECODE_VOCAB_BYTES = 32
# The caching allocator's slack over a rollout phase: blocks rounded up and split, segments cached
# from the update that the pool's allocations cannot reuse.
ALLOCATOR_SLACK = 0.04
# Of the memory left beside the weights, what ``size_rollout_memory`` gives one prefill (the
# rest goes to the KV pool): a prefill at least one sequence long, at most the engine's default.
PREFILL_SHARE = 0.1
CARD_HEADROOM = 0.05  # of the card, left free by ``size_rollout_memory`` for what no estimate counts


@dataclass
class ModelShape:
    """What memory depends on, read from a model (real, or built on the meta device)."""

    params: int  # distinct parameters (tied weights once)
    trainable: int  # parameters with requires_grad
    param_bytes: int  # bytes per parameter as held for training (the frozen base's, under LoRA)
    trainable_bytes: int  # bytes per trainable parameter (its gradient and Adam moments have the same)
    layers: int
    hidden: int
    intermediate: int
    q_width: int  # attention heads x head_dim
    kv_width: int  # key/value heads x head_dim
    layer_factors: tuple[float, ...] = ()  # per layer, saved bytes over a Llama block's (empty: all 1)
    root_params: int = 0  # outside the decoder layers: embeddings and head (FSDP2's root unit)
    vocab: int = 0  # rows of the LM head (0: logits not counted)

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        params = list(base.parameters())
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        ends = {id(p): p for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None
                for p in m.parameters()}
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            params=sum(p.numel() for p in params),
            trainable=sum(p.numel() for p in trainable),
            param_bytes=(frozen or params)[0].element_size(),
            trainable_bytes=trainable[0].element_size() if trainable else 0,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            q_width=heads * head_dim,
            kv_width=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
            layer_factors=hybrid_layer_factors(config),
            root_params=sum(p.numel() for p in ends.values()),
            vocab=getattr(config, "vocab_size", 0) or 0,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_width * dtype_bytes

    def weight_bytes(self) -> int:
        frozen = self.params - self.trainable
        return frozen * self.param_bytes + self.trainable * self.trainable_bytes

    def layer_bytes_per_token(self, compute_bytes: int) -> int:
        """One decoder layer's tensors saved for the backward pass, per token (module docstring)."""
        c, r = compute_bytes, max(self.param_bytes, self.trainable_bytes)
        h, q, kv, inter = self.hidden, self.q_width, self.kv_width, self.intermediate
        return 2 * (r + c) * h + 2 * c * h + (4 + c) * (q + kv) + c * (3 * q + 2 * kv) + 4 * c * inter

    def activation_bytes_per_token(self, checkpointing: bool, compute_bytes: int, fused_swiglu: bool = False) -> int:
        """Tensors saved for the backward pass, per token (see the module docstring). ``fused_swiglu``:
        Liger's SwiGLU saves the gate and up projections only and recomputes the activation in the
        backward pass, so each layer saves one intermediate-wide tensor less (the same bytes in a
        hybrid model's layers: its factors scale what the rest of the layer saves)."""
        fused = compute_bytes * self.intermediate if fused_swiglu else 0
        if checkpointing:  # each layer keeps its input; one layer is recomputed at a time
            stored = self.layers * max(self.param_bytes, self.trainable_bytes) * self.hidden
            return stored + self.largest_layer_bytes_per_token(compute_bytes) - fused
        factors = self.layer_factors or (1.0,) * self.layers
        return int(sum(factors) * self.layer_bytes_per_token(compute_bytes)) - self.layers * fused

    def largest_layer_bytes_per_token(self, compute_bytes: int) -> int:
        """The largest layer's saved tensors, per token: what one layer recomputed under
        checkpointing holds, and what a forward pass without autograd holds (its temporaries,
        one layer at a time)."""
        return int(max(self.layer_factors or (1.0,)) * self.layer_bytes_per_token(compute_bytes))

    def prefill_bytes_per_token(self, dtype_bytes: int) -> int:
        """The largest layer's temporaries per token of a prefill without autograd, every tensor in
        the decoded dtype (the rollout copy's or the junior's)."""
        c, h, q, kv, inter = dtype_bytes, self.hidden, self.q_width, self.kv_width, self.intermediate
        return int(max(self.layer_factors or (1.0,)) * (6 * c * h + (4 + c) * (q + kv) + c * (3 * q + 2 * kv) + 4 * c * inter))


def hybrid_layer_factors(config) -> tuple[float, ...]:
    """``HYBRID_LAYER_FACTORS`` per layer for a model with linear-attention layers (Qwen3.5); ()
    for a plain transformer."""
    types = list(getattr(config, "layer_types", None) or [])
    if "linear_attention" not in types:
        return ()
    return tuple(HYBRID_LAYER_FACTORS.get(kind, 1.0) for kind in types)


@dataclass
class StepSettings:
    """The run's settings that size a step's memory."""

    rollout_sequences: int  # sequences per engine call
    sequence_tokens: int  # prompt + completion tokens of one sequence, at most
    micro_batch_tokens: int  # tokens of one forward/backward pass, at most
    rollout_bytes: int  # bytes per parameter of the decoded senior (its rollout copy, or itself)
    rollout_copy: bool  # the engine holds its own copy of the senior
    junior_bytes: int = 0  # bytes per parameter of the junior
    mixed_precision: bool = True  # bf16 compute over float32 weights (autocast)
    checkpointing: bool = False
    offload_optimizer: bool = False
    forward_only_tokens: int | None = None  # tokens of one forward-only pass (log-probs), at most; None: as a training pass
    optimizer_states: int = 2  # AdamW: exp_avg and exp_avg_sq, in the trainable dtype
    reference_copy: bool = False  # a frozen copy of the senior for the KL term
    kv_pool_tokens: int | None = None  # a paged engine's pool (positions); None: slot caches, sequences x tokens
    world: int = 1  # ranks the senior is sharded over (FSDP2); the other parts are per rank
    prefill_tokens: int | None = None  # padded positions of one engine prefill into staging caches; None: not counted
    fused_swiglu: bool = False  # Liger's SwiGLU in the training forward (``memory.fused_kernels``)
    allocator_slack: float = 0.0  # of the rollout phase (``ALLOCATOR_SLACK`` for a run's estimate)
    kv_bytes: int | None = None  # bytes of a cached key/value element (None: each decoded model's own)


@dataclass
class MemoryEstimate:
    rollout: dict[str, int] = field(default_factory=dict)
    update: dict[str, int] = field(default_factory=dict)
    sync: dict[str, int] = field(default_factory=dict)  # FSDP2: the whole senior gathered for the weight sync
    kv_bytes_per_token: int = 0  # both models' K/V of one token position
    slack: float = 0.0  # the allocator's slack, a share of the rollout phase's parts but the fixed overhead
    sequence_tokens: int = 0  # prompt + completion of one sequence, at most

    def kv_tokens_that_fit(self, capacity: int) -> int:
        """Token positions of KV cache that fit in ``capacity`` bytes beside the rest of the rollout
        phase (the update phase holds no KV cache; the slack grows with the pool)."""
        fixed = self.rollout.get("overhead", 0)
        others = sum(self.rollout.values()) - self.rollout.get("KV caches", 0) - self.rollout.get("allocator slack", 0) - fixed
        room = int((capacity - fixed) / (1 + self.slack)) - others
        return max(room, 0) // max(self.kv_bytes_per_token, 1)

    def allocated(self) -> dict[str, int]:
        """Each phase's bytes that torch's allocator holds: all but the fixed overhead (CUDA context,
        cuBLAS workspaces), to set beside ``torch.cuda.max_memory_allocated``."""
        return {phase: sum(parts.values()) - parts.get("overhead", 0)
                for phase, parts in (("rollout", self.rollout), ("update", self.update))}

    @property
    def peak(self) -> int:
        return max(sum(self.rollout.values()), sum(self.update.values()), sum(self.sync.values()))

    def table(self) -> str:
        def phase(name: str, parts: dict[str, int]) -> str:
            items = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
            return f"{name} {sum(parts.values()) / GIB:.1f} GiB ({items})"

        phases = [phase("rollout", self.rollout), phase("update", self.update)]
        if self.sync:
            phases.append(phase("weight sync", self.sync))
        return "; ".join(phases)

    def check(self, capacity: int, device: str = "the GPU") -> None:
        if self.peak <= capacity:
            return
        rollout, update = sum(self.rollout.values()), sum(self.update.values())
        # Only the fixes that shrink a part this step has: a LoRA run is not told to train LoRA adapters.
        trained_state = self.update.get("optimizer state", 0) + self.update.get("gradients", 0)
        lora = ", or train LoRA adapters" if trained_state > GIB else ""
        fixes = []
        # what only sharding or LoRA shrinks: the trained state and the models beside it in the update
        held = sum(v for k, v in self.update.items() if k != "activations")
        whole = trained_state > GIB and held > capacity
        if whole:
            more = ("more GPUs" if self.sync  # (FSDP2 already: each rank holds its share)
                    else "two or more GPUs (trainer.devices: 2, trainer.strategy: fsdp; docs/distributed.md)")
            fixes.append(
                f"full weights do not fit {device} whatever the batch: the update alone holds {held / GIB:.0f} GiB of "
                f"weights, gradients, optimizer state, rollout copy and junior. Train on {more} or train LoRA adapters "
                "(as configs/rlvr/qwen3_4b_tandem_lora_h100.yaml does for the 4B pair on one 80 GB H100, "
                "configs/rlvr/qwen35_9b_2b_tandem_lora.yaml for the Qwen3.5 pair on one GPU)"
            )
            lora = ""
        if rollout > capacity:
            offload = ", set memory.offload_optimizer: true" if self.rollout.get("optimizer state", 0) > GIB else ""
            prefill = ", lower engine.prefill_tokens" if self.rollout.get("prefill caches", 0) > GIB else ""
            fixes.append(f"lower rollout.batch_size or engine.kv_cache_gib (KV caches grow with them; "
                         f"kv_cache_gib: auto sizes the pool to the card){prefill}{offload}{lora}")
        if update > capacity and not whole:
            fixes.append(f"lower memory.micro_batch_tokens / update.micro_batch_size, set memory.gradient_checkpointing: true{lora}")
        if sum(self.sync.values()) > capacity:
            fixes.append(f"the weight sync gathers the whole senior: set memory.offload_optimizer: true{lora}, or shard over more GPUs")
        raise MemoryBudgetError(
            f"a training step needs about {self.peak / GIB:.0f} GiB, {device} has {capacity / GIB:.0f} GiB: "
            f"{self.table()}. To fit: {'; '.join(fixes)} (or memory.check: false to try anyway)"
        )


def estimate_step_memory(senior: ModelShape, junior: ModelShape | None, settings: StepSettings) -> MemoryEstimate:
    s = settings
    shards = s.world
    weights = senior.weight_bytes() // shards
    state = senior.trainable * senior.trainable_bytes * s.optimizer_states // shards
    common = {
        "senior weights": weights,
        "rollout copy": senior.params * s.rollout_bytes if s.rollout_copy else 0,
        "junior": junior.params * s.junior_bytes if junior else 0,
        "reference": senior.params * senior.param_bytes if s.reference_copy else 0,
        "overhead": FIXED_OVERHEAD,
    }
    def both_models(senior_bytes: int, junior_bytes: int) -> int:  # K/V bytes of one token position
        return senior.kv_bytes_per_token(senior_bytes) + (junior.kv_bytes_per_token(junior_bytes) if junior else 0)

    per_token = both_models(s.kv_bytes or s.rollout_bytes, s.kv_bytes or s.junior_bytes)  # the pool's
    staging = both_models(s.rollout_bytes, s.junior_bytes)  # a prefill's staging caches: the models' own dtype
    tokens = s.kv_pool_tokens if s.kv_pool_tokens is not None else s.rollout_sequences * s.sequence_tokens
    rollout = dict(common, **{"KV caches": tokens * per_token, "optimizer state": 0 if s.offload_optimizer else state},
                   **prefill_and_decode(senior, junior, s, staging))
    slack = sum(v for k, v in rollout.items() if k != "overhead")
    rollout["allocator slack"] = int(s.allocator_slack * slack)
    compute = 2 if s.mixed_precision else senior.trainable_bytes or senior.param_bytes
    # a training pass's saved tensors, or a forward-only pass's (more tokens, one layer at a time)
    activations = max(s.micro_batch_tokens * senior.activation_bytes_per_token(s.checkpointing, compute, s.fused_swiglu),
                      (s.forward_only_tokens or 0) * senior.largest_layer_bytes_per_token(compute))
    update = dict(
        common,
        **{
            "gradients": senior.trainable * senior.trainable_bytes // shards,
            "optimizer state": state,
            "activations": activations + LOGIT_CHUNK_BYTES,
            # autocast keeps a bf16 cast of every trainable weight for the backward pass (under
            # FSDP2 the gathered parameters are bf16 already: nothing to cast)
            "autocast weight cache": senior.trainable * 2 if s.mixed_precision and senior.trainable_bytes > 2 and shards == 1 else 0,
        },
    )
    if shards == 1:
        return MemoryEstimate(rollout=rollout, update=update, kv_bytes_per_token=per_token, slack=s.allocator_slack,
                              sequence_tokens=s.sequence_tokens)
    # FSDP2 gathers in the compute dtype: the root unit from forward to backward, a layer and the
    # next one (prefetched) at a time; the weight sync gathers every unit at once
    gathered_bytes = 2 if s.mixed_precision else senior.param_bytes
    layer = (senior.params - senior.root_params) // max(senior.layers, 1)
    update["gathered layers"] = (senior.root_params + 2 * layer) * gathered_bytes
    sync = dict(common, **{"gathered senior": senior.params * gathered_bytes,
                           "optimizer state": 0 if s.offload_optimizer else state})
    return MemoryEstimate(rollout=rollout, update=update, sync=sync, kv_bytes_per_token=per_token, slack=s.allocator_slack,
                          sequence_tokens=s.sequence_tokens)


def prefill_and_decode(senior: ModelShape, junior: ModelShape | None, s: StepSettings, kv_per_token: int) -> dict[str, int]:
    """What a rollout holds beside the weights and the KV pool (module docstring): one prefill of
    ``prefill_tokens`` padded positions (both models' staging caches; the larger model's layer
    temporaries and the padding mask, its rows' last logits) and the decode step's buffers over
    the vocabulary. Empty without ``prefill_tokens``."""
    if s.prefill_tokens is None:
        return {}
    models = [(senior, s.rollout_bytes)] + ([(junior, s.junior_bytes)] if junior else [])
    prefill, rows = s.prefill_tokens, min(s.rollout_sequences, s.prefill_tokens)
    temporaries = max(m.prefill_bytes_per_token(b) for m, b in models)
    mask = prefill * s.sequence_tokens * max(b for _, b in models)  # [rows, 1, width, width] over rows x width
    return {
        "prefill caches": prefill * kv_per_token,
        "prefill activations": prefill * temporaries + mask,
        "prefill logits": sum(rows * m.vocab * (b + 4) for m, b in models),  # the last position's, bf16 and float32
        "decode buffers": sum(s.rollout_sequences * m.vocab * DECODE_VOCAB_BYTES for m, _ in models),
    }


def size_rollout_memory(capacity: int, estimate: MemoryEstimate, sequence_tokens: int, prefill_tokens: int) -> tuple[int, int]:
    """The KV pool (token positions) and the prefill size (padded positions) of a rollout on a card
    of ``capacity`` bytes, from the run's ``estimate`` (made with a prefill of ``prefill_tokens``
    padded positions: its staging caches and temporaries per position): the prefill gets
    ``PREFILL_SHARE`` of what the weights leave (at least one whole sequence, at most
    ``prefill_tokens``), the pool what then fits in all but ``CARD_HEADROOM`` of the card, at most
    the estimate's own KV positions (made with the pool unsized: what a batch can hold at once).
    Raises MemoryBudgetError when not even one sequence of ``sequence_tokens`` fits."""
    usable = int(capacity * (1 - CARD_HEADROOM))
    prefill_now = estimate.rollout.get("prefill caches", 0) + estimate.rollout.get("prefill activations", 0)
    per_position = max(prefill_now // max(prefill_tokens, 1), 1)
    beside = dict(estimate.rollout, **{"KV caches": 0, "allocator slack": 0})
    weights = sum(beside.values()) - prefill_now
    free = int((usable - beside.get("overhead", 0)) / (1 + estimate.slack)) - (weights - beside.get("overhead", 0))
    prefill = min(prefill_tokens, max(sequence_tokens, int(PREFILL_SHARE * free) // per_position))
    room = free - prefill * per_position
    most = estimate.rollout.get("KV caches", 0) // max(estimate.kv_bytes_per_token, 1)
    pool = min(max(room, 0) // max(estimate.kv_bytes_per_token, 1), most)
    if pool < sequence_tokens:
        raise MemoryBudgetError(
            f"the KV pool cannot hold one sequence of {sequence_tokens:,} tokens: {capacity / GIB:.0f} GiB leave "
            f"{max(room, 0) / GIB:.1f} GiB beside the weights and a prefill of {prefill:,} positions "
            f"({estimate.table()}). Lower rollout.max_prompt_tokens / sampling.max_new_tokens, train LoRA adapters, "
            "or use more GPUs"
        )
    return pool, prefill


POOL_HEADROOM = 0.05  # of the device, left free beside a paged pool sized to what fits (7 GiB of an H200)


def kv_budget(estimate: MemoryEstimate, capacity: int | None) -> KVBudget:
    """What the estimate gives the rollout phase's KV caches, for the engine to size its own
    (``RolloutEngine.plan_kv_cache``); ``capacity``: the device's bytes, of which ``POOL_HEADROOM``
    stays free (None: no device to fit)."""
    per_token = max(estimate.kv_bytes_per_token, 1)
    # a pool sized to fill the estimate exactly would leave nothing for what it does not count
    # (the allocator's fragmentation, the graphs of a larger batch ladder): keep a share free
    fit = estimate.kv_tokens_that_fit(int(capacity * (1 - POOL_HEADROOM))) if capacity is not None else None
    sized = None if capacity is None else (
        lambda prefill: size_rollout_memory(capacity, estimate, estimate.sequence_tokens, prefill))
    return KVBudget(estimate.rollout["KV caches"] // per_token, estimate.kv_bytes_per_token, fit, sized)


def estimate_module_memory(module, prompts_per_step: int | None = None, mixed_precision: bool | None = None,
                           decode_dtype: torch.dtype | None = None, world: int | None = None) -> MemoryEstimate:
    """A ``TandemModule``'s step, per GPU, from its models' shapes and settings (``estimate_run_memory``);
    ``prompts_per_step``, ``mixed_precision`` and ``world`` (FSDP2 ranks) default to the data
    module's and trainer's."""
    trainer = module._trainer
    return estimate_run_memory(
        module.senior, module.junior, module.reference is not None, module.engine.rollout_dtype,
        module.rollout_settings, module.update_settings, module.memory,
        prompts_per_step or getattr(getattr(trainer, "datamodule", None), "batch_size", 1),
        "mixed" in str(getattr(trainer, "precision", "32")) if mixed_precision is None else mixed_precision,
        decode_dtype, *module.engine.kv_pool_size(), world=world or getattr(trainer, "world_size", 1),
        prefill_tokens=module.engine.prefill_size(), fused_kernels=module.updates.fused_kernels,
        kv_bytes=module.engine.kv_cache_bytes(),
    )


def plan_device_memory(module) -> MemoryEstimate:
    """When fit starts on a GPU: the engine sizes its KV cache from the step's estimate (before its
    setup), then the estimate counts what it chose, is logged, and is checked against the device
    (``memory.check``)."""
    properties = torch.cuda.get_device_properties(module.device)
    if pool := module.rollouts.plan_kv_cache(kv_budget(estimate_module_memory(module), properties.total_memory)):
        log.info(pool)
    estimate = estimate_module_memory(module)
    log.info("estimated peak GPU memory of a training step: %s", estimate.table())
    if module.memory.check:
        estimate.check(properties.total_memory, properties.name)
    return estimate


def estimate_run_memory(
    senior: nn.Module, junior: nn.Module | None, reference_copy: bool, requested_dtype: str, rollout, update, memory,
    prompts_per_step: int, mixed_precision: bool, decode_dtype: torch.dtype | None = None,
    kv_pool_tokens: int | None = None, kv_pool_gib: float | None = None, world: int = 1,
    prefill_tokens: int | None = None, fused_kernels: tuple[str, ...] = (), kv_bytes: int | None = None,
) -> MemoryEstimate:
    """A training step's memory, per GPU, from the models' shapes and a run's settings
    (``RolloutSettings``, ``UpdateSettings``, ``MemorySettings``); ``decode_dtype`` defaults to the
    engine's rollout dtype (``requested_dtype``) here: pass bf16 to size a GPU run elsewhere. A paged
    engine's pool counts as sized (``kv_pool_tokens`` positions, or ``kv_pool_gib``), else as slot
    caches. ``world``: ranks under FSDP2, each rolling out ``prompts_per_step / world`` prompts.
    ``prefill_tokens``: the engine's prefill size, when it prefills into staging caches (FastEngine).
    ``fused_kernels``: Liger's kernels the update runs (``UpdatePhase.fused_kernels``, known once fit
    starts; none counts PyTorch's, which save more). ``kv_bytes``: of a cached key or value element,
    where the engine caches in its own dtype (``RolloutEngine.kv_cache_bytes``)."""
    from tandem_lit.rollout.weights import needs_copy, rollout_dtype

    if decode_dtype is None and requested_dtype != "live":
        decode_dtype = rollout_dtype(requested_dtype, senior)
    copy = decode_dtype is not None and needs_copy(senior, decode_dtype)
    senior_shape = ModelShape.of(senior)
    junior_shape = ModelShape.of(junior) if junior is not None else None
    n = rollout.sampling.n
    step_rollouts = max(1, prompts_per_step // world) * n  # this rank's share
    per_call = max(1, (rollout.batch_size or step_rollouts) // n) * n
    sequence_tokens = (rollout.max_prompt_tokens or 512) + rollout.sampling.max_new_tokens
    micro_tokens = update.micro_batch_size * sequence_tokens
    if memory.micro_batch_tokens is not None:  # a pass holds the bound's tokens (or one longer row)
        bound = max(memory.micro_batch_tokens, sequence_tokens)
        micro_tokens = bound if memory.fill_passes else min(micro_tokens, bound)
    settings = StepSettings(
        rollout_sequences=min(per_call, step_rollouts),
        sequence_tokens=sequence_tokens,
        micro_batch_tokens=micro_tokens,
        forward_only_tokens=micro_tokens * memory.forward_only_pass_scale,
        rollout_bytes=decode_dtype.itemsize if copy else senior_shape.param_bytes,
        rollout_copy=copy,
        junior_bytes=junior_shape.param_bytes if junior_shape else 0,
        mixed_precision=mixed_precision,
        checkpointing=memory.gradient_checkpointing,
        offload_optimizer=memory.offload_optimizer,
        reference_copy=reference_copy,
        kv_pool_tokens=kv_pool_tokens,
        world=world,
        prefill_tokens=prefill_tokens,
        allocator_slack=ALLOCATOR_SLACK,
        fused_swiglu="swiglu" in fused_kernels,
        kv_bytes=kv_bytes,
    )
    estimate = estimate_step_memory(senior_shape, junior_shape, settings)
    if kv_pool_gib is not None:
        settings.kv_pool_tokens = int(kv_pool_gib * GIB) // estimate.kv_bytes_per_token
        estimate = estimate_step_memory(senior_shape, junior_shape, settings)
    return estimate
