"""Full training steps of a run config on one device: tandem vs plain GRPO, measured in one run.

Real-shape random models (the config's architectures, ``random_init``) with the real Qwen3
tokenizer and chat template, real DeepScaleR prompts, the config's TandemModule settings as
written (float32 master, bf16-mixed, GRPO, mini-batches, rollout_batch_size...) inside
Lightning's ``fit``. Random weights never stop early, so every rollout runs to the token cap (the
worst case; EOS is ignored so that holds exactly). The verifier is replaced by a deterministic
coin on the completion's text (math-verify needs no GPU time, and random text is never right:
the coin gives GRPO groups mixed rewards, so the update does real work).

    python benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml \
        --tokenizer ../shared/models/qwen3-tokenizer \
        --problems ../shared/data/deepscaler/train/deepscaler_subset_803.json
    python benchmarks/train_step.py --device cpu --tiny          # CI-sized check of this script
    python benchmarks/train_step.py --config configs/rlvr/qwen35_9b_2b_tandem.yaml --estimate-only
    python benchmarks/train_step.py --devices 2 --strategy fsdp ...   # FSDP2, one process per GPU

Per step it prints rollout and update seconds, rollout tokens/s, the decode step against the bf16
roofline (bytes one step must read: the decoded weights of both models + their KV caches at the
mean length, over the copy bandwidth measured in the same run), the engine's setup (cache
allocation + graph capture), the rollout-vs-train log-prob gap and peak memory; then the plain
GRPO arm (SoloHandoff, no junior: configs/rlvr/qwen3_4b_grpo.yaml) with the same shapes. The
first two steps of each arm are short warm-ups (Triton compilation, cuBLAS init, pinned host
buffers for the optimizer offload) and are not reported.
Each step also prints the update's model FLOPs (``update_flops``: counted from the shapes of the
sequences trained on, attention included) and its MFU against ``--peak-tflops`` (790: an H200's
dense bf16 rate).
Last line: ``tandem_over_grpo_step=<ratio> ideal=<ratio> peak_gb=<x>``, where ideal applies the
decode-bytes ratio (tandem over solo) to GRPO's rollout time and keeps its update time.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import lightning as L
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import copy_bandwidth, draw_budgets, parse_lengths  # noqa: E402  (benchmarks/rollout.py: the same roofline inputs and length draws)

from tandem_lit.data.base import PromptDataModule  # noqa: E402
from tandem_lit.training.distributed import FSDP2Strategy  # noqa: E402
from tandem_lit.training.memory import GIB  # noqa: E402
from tandem_lit.verifiers.base import Grade, Verifier  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H200_BYTES = 139 * GIB  # an H200's total memory as torch.cuda reports it (about)
VLLM_DEFAULTS = '{"sleep_level": 2, "kv_cache_gib": "plan", "max_model_len": 4096}'  # configs/rlvr/qwen3_4b_grpo_vllm.yaml

# Architectures of the hub models the configs name (their config.json values that matter here)
QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_act="silu",
             rms_norm_eps=1e-6, max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
             tie_word_embeddings=True, attention_bias=False, head_dim=128)
SHAPES = {
    "Qwen/Qwen3-4B-Instruct-2507": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                        num_attention_heads=32, num_key_value_heads=8, rope_theta=5_000_000.0),
    "Qwen/Qwen3-1.7B": dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, rope_theta=1_000_000.0),
    # Qwen3.5 text models (hybrid: Gated DeltaNet + full attention): transformers' Qwen3_5TextConfig
    # defaults are the 9B; the 2B values are ASSUMED (not published where we could read them)
    "Qwen/Qwen3.5-9B": dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"]),
    "Qwen/Qwen3.5-2B": dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=2048,
                            intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                            tie_word_embeddings=True),
}


def shape_config(hub_name: str, **overrides):
    """The transformers config of ``hub_name``'s shape (``SHAPES``), ``overrides`` on top."""
    from transformers import AutoConfig

    values = dict(SHAPES[hub_name], **overrides)
    return AutoConfig.for_model(values.pop("model_type"), **values)


class CoinVerifier(Verifier):
    """A deterministic coin on the completion text: mixed rewards for random models, no grading cost."""

    def grade(self, completion: str, **columns) -> Grade:
        heads = zlib.crc32(completion.encode()) % 2 == 1
        return Grade(correct=heads, reward=float(heads))


class ProblemRows(PromptDataModule):
    """Math rows (prompt + boxed-answer instruction) from a DeepScaleR-style JSON list."""

    def __init__(self, problems: str, **kwargs):
        super().__init__(**kwargs)
        self.problems = problems

    def load_split(self, split):
        from tandem_lit.data.base import read_records
        from tandem_lit.data.math import BOXED_INSTRUCTION, math_row

        records = read_records(self.problems)
        return [math_row(r, "deepscaler", self.problems, i, BOXED_INSTRUCTION) for i, r in enumerate(records)]


def model_folder(hub_name: str, tokenizer: str, root: Path) -> str:
    """A folder with the architecture's config.json and the real tokenizer (random weights)."""
    folder = root / hub_name.replace("/", "__")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[hub_name]))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer) / name, folder / name)
    return str(folder)


PARTIAL = "+partial"  # an arm's name with this suffix: the same arm with rollout.partial (--partial)
KEEP = "+keep-"  # ... then this and a keep_caches value other than none (--keep-caches)
FP8 = "+fp8"  # ... and with this one: with FastEngine's 8-bit KV cache (--compare-fp8)
ROWS = "+rows-order"  # ... then this: FastEngine's decode attention in row order (--compare-attention-order)
UNRESTRICTED = "+unrestricted"  # an arm scored as before issue 51's fix, beside the as-drawn one (--switch-scoring as-drawn unrestricted)


def partial_arms(arm: str, keep_caches: list[str]) -> list[str]:
    """``arm``'s partial arms, one per ``rollout.partial.keep_caches`` value."""
    return [arm + PARTIAL + ("" if keep == "none" else KEEP + keep) for keep in keep_caches]


def set_fast_engine_args(init: dict, arm: str, flag: str, drop: tuple[str, ...] = (), **values) -> None:
    """The module's engine (FastEngine unless the config names one) with ``values`` over its init
    args (``drop``: the config's that the flag replaces); ``flag`` names what asked, if the config's
    engine is another."""
    engine = init.get("engine") or {"class_path": "FastEngine"}
    if not engine["class_path"].endswith("FastEngine"):
        raise SystemExit(f"{flag}; the {arm} arm runs {engine['class_path']}")
    kept = {k: v for k, v in (engine.get("init_args") or {}).items() if k not in drop}
    init["engine"] = dict(engine, init_args=dict(kept, **values))


def build_module(model_args: dict, arm: str, args, root: Path):
    """TandemModule from the config's ``model`` section (jsonargparse, as the CLI reads it) with
    the benchmark's overrides; ``arm`` grpo turns the handoff solo and drops the junior, and
    grpo-vllm also decodes with VLLMEngine (``--vllm-kwargs``)."""
    from jsonargparse import ArgumentParser

    import tandem_lit.objectives  # noqa: F401  (short class_path names, as in the CLI)
    import tandem_lit.rollout  # noqa: F401
    from tandem_lit.training.module import TandemModule

    arm = arm.removesuffix(UNRESTRICTED)  # (run_arm applies it to the built module)
    rows_order, arm = arm.endswith(ROWS), arm.removesuffix(ROWS)
    fp8, arm = arm.endswith(FP8), arm.removesuffix(FP8)
    arm, _, keep = arm.partition(KEEP)
    partial, arm = arm.endswith(PARTIAL), arm.removesuffix(PARTIAL)
    init = copy.deepcopy(model_args)
    init.pop("verifier")
    if not args.tiny:
        for role in ("senior", "junior"):
            if init.get(role):
                init[role] = dict(init[role], path=model_folder(init[role]["path"], args.tokenizer, root), random_init=True)
    if args.attn_implementation:  # the senior's training forward (packed passes need one that keeps sequences apart)
        init["senior"] = dict(init["senior"], attn_implementation=args.attn_implementation)
    rollout = init["rollout"] = dict(init.get("rollout") or {})
    update = init["update"] = dict(init.get("update") or {})
    rollout["sampling"] = dict(rollout.get("sampling") or {}, ignore_eos=True)
    for key, value in (("n", args.n), ("max_new_tokens", args.max_new_tokens)):
        if value is not None:
            rollout["sampling"][key] = value
    if args.rollout_batch_size is not None:
        rollout["batch_size"] = args.rollout_batch_size
    for key in ("micro_batch_size", "mini_batch_size"):
        if getattr(args, key) is not None:
            update[key] = getattr(args, key)
    # the benchmark reports the rollout-vs-train gap of every step; a run would stop past the limit
    update["logp_gap_limit"] = args.logp_gap_limit
    if args.lora:
        init["lora"] = {"r": args.lora, "alpha": 2 * args.lora, "dropout": 0.0, "load_in_4bit": args.qlora}
        if args.qlora:  # QLoRA: a 4-bit NF4 base (bf16 compute), the Tandem Training setting
            init["senior"] = dict(init["senior"], dtype="bfloat16")
    memory = dict(init.get("memory") or {})
    memory.update({k: v for k, v in (("offload_optimizer", args.offload_optimizer),
                                     ("gradient_checkpointing", args.gradient_checkpointing),
                                     ("micro_batch_tokens", args.micro_batch_tokens),
                                     ("pack_sequences", args.pack_sequences),
                                     ("fill_passes", args.fill_passes),
                                     ("fused_kernels", args.fused_kernels),
                                     ("release_rollout_caches", args.release_rollout_caches)) if v is not None})
    init["memory"] = memory
    if args.rollout_dtype:
        init["engine"] = {"class_path": "FastEngine" if not args.hf_engine else "HFEngine",
                          "init_args": {"rollout_dtype": args.rollout_dtype}}
    else:
        configured = (init.get("engine") or {}).get("class_path", "").endswith("VLLMEngine")
        if arm == "grpo-vllm" and (args.vllm_kwargs is not None or not configured):
            init["engine"] = {"class_path": "VLLMEngine", "init_args": json.loads(args.vllm_kwargs or VLLM_DEFAULTS)}
        elif arm != "grpo-vllm" and configured:
            init.pop("engine")  # a vLLM config's tandem and FastEngine arms: the default engine
    if args.kv_cache and arm != "grpo-vllm":  # FastEngine's KV layout (paged: a pool sized by the memory plan)
        # the layout given here comes with its own pool size (--kv-cache-gib, else the memory plan's), not the config's
        pool = {"kv_cache_gib": args.kv_cache_gib} if args.kv_cache_gib else {}
        set_fast_engine_args(init, arm, "--kv-cache sets FastEngine's KV layout", drop=("kv_cache_gib", "kv_cache_tokens"),
                             kv_cache=args.kv_cache, **pool)
    kv_dtype = "fp8" if fp8 else args.kv_cache_dtype
    if kv_dtype and arm != "grpo-vllm":  # FastEngine's cache element type (fp8: 8-bit keys and values)
        set_fast_engine_args(init, arm, "--kv-cache-dtype sets FastEngine's cache dtype", kv_cache_dtype=kv_dtype)
    if args.attention_split and arm != "grpo-vllm":  # FastEngine's decode attention in chunks of slots
        set_fast_engine_args(init, arm, "--attention-split sets FastEngine's attention", attention_split=args.attention_split)
    if rows_order:  # the decode attention's programs row-major, as before they started longest row first
        set_fast_engine_args(init, arm, "--compare-attention-order sets FastEngine's attention", attention_order="rows")
    # what draws tokens from a policy the trainer does not compute (8-bit keys and values, or the
    # senior's keys kept over the update) trains with the objective's correction, which fit requires
    if kv_dtype == "fp8" and arm != "grpo-vllm" or partial and keep == "both":
        objective = init["objective"] = dict(init["objective"])
        objective["init_args"] = dict(objective.get("init_args") or {})
        if objective["init_args"].get("tis_cap") is None:  # verl's 2.0; a config's own stays
            objective["init_args"]["tis_cap"] = 2.0
    evaluation = init["evaluation"] = dict(init.get("evaluation") or {}, at_start=False, modes=["senior"])
    init["logging"] = dict(init.get("logging") or {}, completions_every_n_steps=0)
    if partial:  # partial rollouts: more prompt groups in flight than a step trains
        rollout["partial"] = {"in_flight_prompts": args.partial, "max_staleness": args.max_staleness,
                              "keep_caches": keep or "none"}
    if arm in ("grpo", "grpo-vllm"):
        init["handoff"] = {"class_path": "SoloHandoff", "init_args": {"author": "senior"}}
        init.pop("junior", None)
        evaluation.pop("test_handoff", None)
        evaluation.pop("handoff", None)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(TandemModule, "model", skip={"verifier"}, instantiate=False)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    namespace = instantiate(parser.parse_object({"model": init}))
    # (by key, not vars(): jsonargparse stores a field named like a Namespace method, ``update``, escaped)
    kwargs = {k: namespace.model[k] for k in namespace.model.keys() if "." not in k and not k.startswith("__")}
    return TandemModule(verifier=CoinVerifier(), **kwargs)


def update_flops(
    body_params: int, head_params: int, attention_width: int, trainable_share: float,
    prompts: list[int], completions: list[int], forward_only_rows: list[int],
) -> float:
    """Model FLOPs of one update phase, counted from the shapes of the sequences trained on.

    For sequence i of L_i = prompt_i + completion_i real tokens (padding is not model work), one
    forward is

        F_i = 2 N L_i  +  2 V H c_i  +  2 A L_i^2

    N = ``body_params`` (the decoder's matmul parameters: all but the input embedding and the
    output head), V H = ``head_params`` (the vocabulary projection, run only at the c_i completion
    positions), A = ``attention_width`` (full-attention layers x heads x head_dim): QK^T and AV are
    2 products x 2 FLOPs per multiply-add x L^2 / 2 (causal) per layer and head dimension. The
    backward pass is 2x the forward for attention and for the matmuls' input gradients, plus the
    weight gradients of the trained share s of the parameters (s = 1: all, the familiar 6 N per
    token; s ~ 0: LoRA over a frozen base, adapters' own FLOPs ignored):

        trained_i = (2 + s) (2 N L_i + 2 V H c_i)  +  3 (2 A L_i^2)

    Forward-only passes (the old log-probs of the mini-batches after the first, the reference
    log-probs of a KL term) add F_i once per row listed in ``forward_only_rows``. Not counted:
    recomputation under gradient checkpointing (hardware, not model, FLOPs), norms, activations,
    softmax, rotary, the optimizer step, and a linear-attention layer's recurrence (Qwen3.5's Gated
    DeltaNet layers count only through their parameters).
    """

    def forward(i: int) -> float:
        length = prompts[i] + completions[i]
        return 2 * body_params * length + 2 * head_params * completions[i] + 2 * attention_width * length**2

    trained = 0.0
    for i in range(len(prompts)):
        length = prompts[i] + completions[i]
        matmuls = 2 * body_params * length + 2 * head_params * completions[i]
        trained += (2 + trainable_share) * matmuls + 3 * 2 * attention_width * length**2
    return trained + sum(forward(i) for i in forward_only_rows)


def flop_shape(model) -> dict:
    """``update_flops``' model arguments read from a (possibly LoRA-wrapped) causal LM."""
    from tandem_lit.rollout.weights import plain_model
    from tandem_lit.training.memory import ModelShape

    lm = plain_model(model)
    params = {id(p): p for p in lm.parameters()}
    embed, head = lm.get_input_embeddings().weight, lm.get_output_embeddings().weight
    total = sum(logical_numel(p) for p in params.values())
    body = total - embed.numel() - (head.numel() if id(head) != id(embed) else 0)
    shape = ModelShape.of(model)
    kinds = list(getattr(lm.config, "layer_types", None) or [])
    full_layers = sum(kind != "linear_attention" for kind in kinds) if kinds else shape.layers
    return {"body_params": body, "head_params": head.numel(), "attention_width": full_layers * shape.q_width,
            "trainable_share": shape.trainable / total}


def logical_numel(param) -> int:
    """The weights a parameter stands for: a bitsandbytes 4-bit weight stores two per byte (its
    ``numel`` is half the matrix's) and keeps the matrix's shape in its ``quant_state``."""
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else param.numel()


class UpdateShapes:
    """Records each update phase's sequences (prompt and completion lengths) and the rows that get
    forward-only passes, by wrapping the module's ``UpdatePhase.run``."""

    def __init__(self, module) -> None:
        self.module, self.steps = module, []
        run = module.updates.run

        def recorded(result, optimizer, device, world=1, step=0):
            self.record(result, world)
            return run(result, optimizer, device, world, step)

        module.updates.run = recorded

    def record(self, result, world: int) -> None:
        rollout, group, phase = result.rollout, result.group, self.module.updates
        prompts = int(group.max()) + 1
        per_update = phase.settings.mini_batch_size // world if phase.settings.mini_batch_size else prompts
        rows = list(range(len(group)))
        later = [i for i in rows if int(group[i]) >= per_update]  # mini-batches after the first
        forward_only = (later if phase.objective.uses_old_logp else []) + (rows if phase.objective.uses_reference else [])
        self.steps.append({"prompts": rollout.prompt_mask.sum(-1).tolist(), "completions": rollout.lengths.tolist(),
                           "forward_only_rows": forward_only})


class LogprobRecorder:
    """Keeps, for ``--dump-logprobs``, every teacher-forced pass of the update (the rows it scored:
    prompt and completion ids, authors, the engine's log-probs, the training forward's), by
    wrapping the module's ``UpdatePhase.sequence_logprobs``: a gap can then be taken apart offline
    (by position, row, budget, token) from one run."""

    def __init__(self, module) -> None:
        self.passes: list[dict] = []
        score = module.updates.sequence_logprobs

        def recorded(model, rollout, temperature=None, lengths=None):
            logp = score(model, rollout, temperature, lengths=lengths)
            self.passes.append({"prompt_ids": rollout.prompt_ids.cpu(), "prompt_mask": rollout.prompt_mask.cpu(),
                                "completion_ids": rollout.completion_ids.cpu(), "author": rollout.author.cpu(),
                                "engine_logprobs": None if rollout.senior_logprobs is None else rollout.senior_logprobs.float().cpu(),
                                "train_logprobs": logp.detach().float().cpu(), "temperature": temperature})
            return logp

        module.updates.sequence_logprobs = recorded


class UpdateProfiler:
    """For ``--profile-update``: torch.profiler over the update (log-prob passes, trained passes,
    optimizer) of one extra step after the measured ones, by wrapping ``UpdatePhase.run``. Writes the kernels with the
    most CUDA time, the host ops with the most CPU time, and how much of the update's wall time
    the GPU was busy (kernel time over wall time: the rest is launch gaps and host work)."""

    def __init__(self, module, skip: int, path: str, rows: int = 30) -> None:
        self.calls, self.skip, self.path, self.rows = 0, skip, path, rows
        run = module.updates.run

        def profiled(result, optimizer, device, world=1, step=0):
            self.calls += 1
            if self.calls != self.skip + 1:
                return run(result, optimizer, device, world, step)
            from torch.profiler import ProfilerActivity, profile

            cuda = device.type == "cuda"
            wait = torch.cuda.synchronize if cuda else (lambda: None)
            wait()
            started = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])], record_shapes=True) as prof:
                out = run(result, optimizer, device, world, step)
                wait()
            self.write(prof, time.perf_counter() - started)
            return out

        module.updates.run = profiled

    def write(self, prof, wall: float) -> None:
        events = prof.key_averages()
        kernels = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
        with open(self.path, "w") as f:
            f.write(f"update wall {wall:.2f} s (profiled), GPU kernels {kernels:.2f} s = {kernels / wall:.1%} busy\n\n")
            f.write(events.table(sort_by="self_device_time_total", row_limit=self.rows, max_name_column_width=70))
            f.write("\n\n")
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=self.rows, max_name_column_width=70))
            f.write("\n\n" + idle_gaps(prof.events()))
            f.write("\n\nby input shapes (which matmul is which):\n")
            f.write(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_device_time_total" if kernels else "self_cpu_time_total", row_limit=self.rows,
                max_name_column_width=40, max_shapes_column_width=80))
        say(f"update profile written to {self.path}: GPU busy {kernels / wall:.1%} of {wall:.1f} s")


def idle_gaps(events, rows: int = 25) -> str:
    """Where the GPU waited: the gaps between the kernels of a profile, by size (many short ones:
    launch-bound host code; few long ones: host work or a sync), and each gap charged to the
    innermost host op running at its start (the op the GPU was waiting for)."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
    host = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type.name == "CPU")
    if not kernels:
        return "no CUDA kernels\n"
    gaps, reach = [], kernels[0][1]
    for start, end in kernels[1:]:
        if start > reach:
            gaps.append((reach, start - reach))
        reach = max(reach, end)
    buckets = {"< 0.1 ms": 0.0, "0.1-1 ms": 0.0, "1-10 ms": 0.0, ">= 10 ms": 0.0}
    counts = dict.fromkeys(buckets, 0)
    charged: dict[str, list[float]] = {}
    starts = [h[0] for h in host]
    import bisect

    for at, length in gaps:
        bucket = ("< 0.1 ms" if length < 100 else "0.1-1 ms" if length < 1000 else "1-10 ms" if length < 10000 else ">= 10 ms")
        buckets[bucket] += length / 1e6
        counts[bucket] += 1
        if length < 100:
            continue
        # the innermost host op open at the gap's start: the latest-starting one that has not ended
        name = "(no host op)"
        for k in range(bisect.bisect_right(starts, at) - 1, max(-1, bisect.bisect_right(starts, at) - 400), -1):
            if host[k][1] >= at:
                name = host[k][2]
                break
        entry = charged.setdefault(name, [0.0, 0])
        entry[0] += length / 1e6
        entry[1] += 1
    lines = [f"GPU idle between kernels: {sum(buckets.values()):.2f} s in {len(gaps)} gaps"]
    lines += [f"  {name:>9}: {seconds:7.2f} s in {counts[name]} gaps" for name, seconds in buckets.items()]
    lines.append("gaps >= 0.1 ms by the host op open at their start:")
    for name, (seconds, count) in sorted(charged.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"  {seconds:8.3f} s  {count:6d}x  {name[:90]}")
    return "\n".join(lines) + "\n"


class StepReport(L.Callback):
    """Times each training step and reports it as soon as it ends (Lightning's teardown after
    ``fit`` moves tens of GB to the host: a time limit there must not lose the numbers). The first
    ``warmup`` steps run at ``warmup_tokens`` (Triton compilation, cuBLAS init, and the offload's
    pinned host buffers, allocated once at the first rollout after an update) and are not reported."""

    def __init__(self, arm: str, warmup: int, warmup_tokens: int, bandwidth: float, prompts: int, peak_tflops: float,
                 fixed_lengths: bool = True, measured: int = 1, profiled: int = 0):
        self.arm, self.warmup, self.warmup_tokens, self.bandwidth, self.prompts = arm, warmup, warmup_tokens, bandwidth, prompts
        self.measured = measured  # steps reported after the warm-up
        # the run stops after these data batches (max_steps counts optimiser updates, and a partial
        # step that trains few groups makes fewer than a full one)
        self.batches = warmup + measured + profiled
        # the roofline counts every row at the mean length of a fixed-length run: with per-row
        # budgets rows finish early and a step reads less, so a share of it would mislead
        self.fixed_lengths = fixed_lengths
        self.peak_tflops = peak_tflops
        self.steps: list[dict] = []
        self.full_tokens = None
        self.shapes: UpdateShapes | None = None

    def on_fit_start(self, trainer, module):
        self.shapes = UpdateShapes(module)
        self.device_used = self.rollout_device_used = 0.0
        if trainer.strategy.root_device.type == "cuda":
            release = module.engine.release

            def sampled_release():  # the rollout's high point: caches (vLLM's KV pool) still held
                self.sample_device_memory()
                self.rollout_device_used = max(self.rollout_device_used, self.device_used)
                release()

            module.engine.release = sampled_release

    def sample_device_memory(self) -> None:
        """Memory in use on the device (all allocators: vLLM's sleep-mode pool included) in GiB."""
        free, total = torch.cuda.mem_get_info()
        self.device_used = max(self.device_used, (total - free) / GIB)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.full_tokens is None:
            self.full_tokens = module.sampling.max_new_tokens
        module.sampling.max_new_tokens = self.warmup_tokens if batch_idx < self.warmup else self.full_tokens
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # (the module resets the allocator's peak as its step starts)
            self.device_used = self.rollout_device_used = 0.0
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
            self.sample_device_memory()
        seconds = time.perf_counter() - self.started
        if batch_idx + 1 >= self.batches:
            trainer.should_stop = True
        if batch_idx >= self.warmup + self.measured:
            say(f"{self.arm:>7} profiled step: {seconds:.1f} s (under torch.profiler: not a measurement)")
        elif batch_idx >= self.warmup:
            self.report(module, seconds)
        else:  # unreported, but a gap there (before any update reached the engine) narrows a gap's cause
            row = module.history[-1]
            say(f"{self.arm:>7} warm-up step {batch_idx + 1}: {seconds:.1f} s; logp gap mean "
                f"{row.get('train/rollout_logp_gap_mean', float('nan')):.4f} max "
                f"{row.get('train/rollout_logp_gap_max', float('nan')):.3f}")

    def report(self, module, seconds: float) -> None:
        row = module.history[-1]
        tokens = row["train/response_length"] * self.prompts * module.sampling.n
        step = {
            "step_seconds": seconds,
            "rollout_seconds": row["train/rollout_seconds"],
            "update_seconds": row["train/update_seconds"],
            "rollout_tokens_per_second": tokens / row["train/rollout_seconds"],
            "setup_seconds": row.get("train/rollout_setup_seconds", float("nan")),
            "prefill_seconds": row.get("train/rollout_prefill_seconds", float("nan")),
            "decode_step_ms": row.get("train/decode_step_ms", float("nan")),
            "logp_gap_mean": row.get("train/rollout_logp_gap_mean", float("nan")),
            "logp_gap_max": row.get("train/rollout_logp_gap_max", float("nan")),
            "peak_gb": row.get("train/peak_memory_gb", float("nan")),
            "device_used_gb": self.device_used,
            "rollout_device_used_gb": self.rollout_device_used,
            "decode_seconds": row.get("train/rollout_decode_seconds", float("nan")),
            "decode_steps": row.get("train/rollout_decode_steps", float("nan")),
            "preemptions": row.get("train/rollout_preemptions", 0.0),
            "resumed_tokens": row.get("train/rollout_resumed_tokens", 0.0),
            "prefill_positions": row.get("train/rollout_prefill_positions", 0.0),
            "prefill_padded_positions": row.get("train/rollout_prefill_padded_positions", 0.0),
            "kept_positions": row.get("train/rollout_kept_positions", 0.0),
            "restored_positions": row.get("train/rollout_restored_positions", 0.0),
            "keep_seconds": row.get("train/rollout_keep_seconds", 0.0),
            "kv_pool_peak_fraction": row.get("train/rollout_kv_pool_peak_fraction", float("nan")),
            "offload_seconds": row.get("train/optimizer_offload_seconds", 0.0),
            **{f"update_{part}_seconds": row.get(f"train/update_{part}_seconds", float("nan"))
               for part in ("logprob", "passes", "optimizer")},
            "response_length": row["train/response_length"],
            "prompt_width": row.get("train/rollout_prompt_width", float("nan")),
            "mismatch_kl": row.get("train/mismatch_kl", float("nan")),
            "mismatch_ess": row.get("train/mismatch_ess", float("nan")),
            "busy_slot_fraction": row.get("train/rollout_busy_slot_fraction", float("nan")),
            # rows writing a token in a mean decode step, of rollout.batch_size (issue 54's "live rows")
            "mean_live_rows": row.get("train/rollout_mean_live_rows", float("nan")),
            **{key.removeprefix("train/"): value for key, value in row.items()
               if key.startswith(("train/partial_", "train/stale_token_"))},
        }
        step["live_row_fraction"] = step["mean_live_rows"] / module.rollouts.settings.batch_size
        step["roofline_ms"] = 1000 * decode_bytes(module, step["prompt_width"]) / self.bandwidth
        # what the decode really read (FastEngine: weights a step, the keys and values its attention
        # read), at any lengths, over the copy rate measured in this run
        step["decode_read_tb_per_s"] = row.get("train/rollout_decode_read_tb_per_s", float("nan"))
        step["decode_read_share"] = step["decode_read_tb_per_s"] * 1e12 / self.bandwidth
        step["decode_roofline_share"] = step["roofline_ms"] / step["decode_step_ms"]
        shapes = self.shapes.steps[-1] if self.shapes and self.shapes.steps else None
        flops = update_flops(**flop_shape(module.senior), **shapes) if shapes else float("nan")
        # (several processes: rank 0's rows against one GPU's peak)
        step["update_tflops"] = flops / 1e12
        step["update_mfu"] = flops / (step["update_seconds"] * self.peak_tflops * 1e12)
        step["update_trained_tokens"] = sum(shapes["prompts"]) + sum(shapes["completions"]) if shapes else 0
        self.steps.append(step)
        if "train/partial_in_flight_groups" in row:
            say(f"{self.arm:>7} partial: {row['train/partial_in_flight_groups']:.0f} groups in flight, "
                f"{row['train/partial_trained_groups']:.0f} trained, {row['train/partial_carried_groups']:.0f} carried "
                f"({row['train/partial_paused_sequences']:.0f} sequences paused); stale tokens "
                f"{row.get('train/stale_token_fraction', 0.0):.1%} (mean age {row.get('train/stale_token_mean_age', 0.0):.2f}); "
                f"busy slots {row.get('train/rollout_busy_slot_fraction', float('nan')):.0%}")
        roofline = (f" ({step['decode_roofline_share']:.0%} of the roofline of every row decoding at once, {step['roofline_ms']:.2f} ms)"
                    if self.fixed_lengths else "")
        if step["decode_read_tb_per_s"] == step["decode_read_tb_per_s"]:  # (not NaN: FastEngine on plain models)
            roofline += f", reading {step['decode_read_tb_per_s']:.2f} TB/s"
            if step["decode_read_share"] == step["decode_read_share"]:  # (a GPU: the copy rate was measured)
                roofline += f" ({step['decode_read_share']:.0%} of the copy rate)"
        live = (f"{step['mean_live_rows']:.0f} of {module.rollouts.settings.batch_size} rows live "
                f"({step['live_row_fraction']:.0%}); " if step["mean_live_rows"] == step["mean_live_rows"] else "")
        restored = (f"{step['restored_positions']:,.0f} positions' caches copied back, {step['kept_positions']:,.0f} kept "
                    f"in {step['keep_seconds']:.2f} s, " if step["kept_positions"] or step["restored_positions"] else "")
        preempted = (f"{step['preemptions']:.0f} preempted, {step['resumed_tokens']:,.0f} tokens prefilled again to resume, "
                     f"prefills over {step['prefill_positions']:,.0f} positions ({step['prefill_padded_positions']:,.0f} padded), {restored}pool "
                     f"peak {step['kv_pool_peak_fraction']:.0%}; " if step["kv_pool_peak_fraction"] == step["kv_pool_peak_fraction"] else "")
        say(f"{self.arm:>7} step {len(self.steps)}: {seconds:7.1f} s = rollout {step['rollout_seconds']:6.1f} s "
              f"(setup {step['setup_seconds']:.2f}, prefill {step['prefill_seconds']:.2f}, decode {step['decode_seconds']:.1f} s = "
              f"{step['decode_steps']:,.0f} steps x {step['decode_step_ms']:.2f} ms{roofline}; {live}{preempted}"
              f"{step['rollout_tokens_per_second']:,.0f} tok/s; optimizer offload "
              f"{step['offload_seconds']:.1f} s) + update {step['update_seconds']:6.1f} s (log-probs "
              f"{step['update_logprob_seconds']:.1f} s, passes {step['update_passes_seconds']:.1f} s, optimizer "
              f"{step['update_optimizer_seconds']:.1f} s; {step['update_tflops']:.3g} "
              f"TFLOP over {step['update_trained_tokens']:,} tokens = {step['update_mfu']:.1%} MFU of {self.peak_tflops:g} "
              f"TFLOP/s); logp gap mean "
              f"{step['logp_gap_mean']:.4f} max {step['logp_gap_max']:.3f}, mismatch_kl {step['mismatch_kl']:.3g} "
              f"ess {step['mismatch_ess']:.6f}; peak {step['peak_gb']:.1f} GiB "
              f"(torch allocator; device in use before the engine releases its caches {step['rollout_device_used_gb']:.1f} GiB, "
              f"the most of that and the step end {step['device_used_gb']:.1f} GiB)")


def rank_zero() -> bool:
    """This is the first (or only) process Lightning runs."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def say(line: str) -> None:
    """Print once (rank 0) when Lightning runs several processes."""
    if rank_zero():
        print(line, flush=True)


def decode_bytes(module, prompt_width: float) -> float:
    """Bytes one decode step reads at the mean length: decoded weights of both models + KV caches."""
    from tandem_lit.training.memory import ModelShape

    engine = module.engine
    sequences = min(module.rollout_settings.batch_size or 10**9, module.trainer.datamodule.batch_size * module.sampling.n)
    mean_length = prompt_width + module.sampling.max_new_tokens / 2
    total = 0.0
    models = [engine.senior] + ([engine.junior] if engine.junior is not None and module.handoff.only_author is None else [])
    for model in models:
        params = {id(p): p for p in model.parameters()}.values()
        dtype_bytes = next(iter(params)).element_size()
        total += sum(p.numel() * p.element_size() for p in params)
        total += sequences * mean_length * ModelShape.of(model).kv_bytes_per_token(dtype_bytes)
    return total


def budgets_for_seeds(lengths: dict, seeds: torch.Tensor, limit: int) -> torch.Tensor:
    """Each sequence's token budget, a lognormal draw keyed by its seed (the same rollout gets the
    same length in both arms and however the rows are split), at most ``limit`` (warm-up steps)."""
    draws = [draw_budgets(lengths, 1, int(seed))[0] for seed in seeds.tolist()]
    return torch.stack(draws).clamp(max=limit)


def score_switch_tokens_unrestricted(module) -> None:
    """The update as it was before switch tokens were scored as drawn (issue 51, item 1): the
    switch codes are dropped from each step's rollouts, so the trainer scores a token drawn from
    the word-start-restricted distribution under the unrestricted one. The engine still records
    the log-prob of the distribution it drew from, so ``mismatch_kl`` then measures the error that
    scoring removed (with the usual bf16 numerics beside it)."""
    phase = module.rollouts
    drawn = phase.training_rollouts

    def unrestricted(*args, **kwargs):
        result, stats = drawn(*args, **kwargs)
        if result is not None:
            result.rollout.token_sets = result.rollout.start_set = result.rollout.end_set = None
        return result, stats

    phase.training_rollouts = unrestricted


def mean_over_steps(steps: list[dict], key: str) -> float:
    """``key``'s mean over the steps that have it (not NaN: a partial step may train carried groups only)."""
    values = [s[key] for s in steps if s[key] == s[key]]
    return sum(values) / len(values) if values else float("nan")


def run_arm(arm: str, model_args: dict, trainer_args: dict, args, root: Path, bandwidth: float) -> dict:
    module = build_module(model_args, arm, args, root)
    if arm.endswith(UNRESTRICTED) or args.switch_scoring == ["unrestricted"]:
        score_switch_tokens_unrestricted(module)
    data = ProblemRows(args.problems, batch_size=args.prompts, seed=0)
    report = StepReport(arm, args.warmup_steps, min(32, module.sampling.max_new_tokens), bandwidth, args.prompts, args.peak_tflops,
                        fixed_lengths=args.lengths == "fixed", measured=args.steps, profiled=int(bool(args.profile_update)))
    lengths = parse_lengths(args.lengths, args.tiny)
    if lengths is not None:  # random weights never end a sequence: each one's budget is its length
        sampling = module.sampling  # (StepReport shortens its max_new_tokens in warm-up steps)
        module.rollouts.token_budgets = lambda seeds: budgets_for_seeds(lengths, seeds, sampling.max_new_tokens)
    updates_per_step = -(-args.prompts // (module.update_settings.mini_batch_size or args.prompts))
    strategy = FSDP2Strategy() if args.strategy == "fsdp" else "auto"
    trainer = L.Trainer(
        accelerator=args.device if args.device == "cpu" else "gpu", devices=args.devices, strategy=strategy,
        precision=trainer_args.get("precision", "32-true"),
        # an upper bound: StepReport stops the run after its batches (a partial step may make fewer updates)
        max_steps=(args.warmup_steps + args.steps + bool(args.profile_update)) * updates_per_step * 4, logger=False,
        enable_checkpointing=False, limit_val_batches=0,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, callbacks=[report],
        default_root_dir=str(root / arm),
    )
    recorder = LogprobRecorder(module) if args.dump_logprobs else None
    if args.profile_update:  # one more step, after the measured ones (the profiler slows what it watches)
        UpdateProfiler(module, args.warmup_steps + args.steps, str(Path(args.profile_update).with_suffix(f".{arm}.txt")))
    trainer.fit(module, datamodule=data)
    if recorder is not None:
        dump = Path(args.dump_logprobs).with_suffix(f".{arm}.pt")
        torch.save({"arm": arm, "passes": recorder.passes}, dump)
        say(f"{arm:>7} teacher-forced passes ({len(recorder.passes)}) written to {dump}")
    estimate = module.metrics.plan or module.memory_estimate(prompts_per_step=args.prompts)  # made at fit start on GPU
    say(f"{arm:>7} memory estimate: {estimate.table()} (peak {estimate.peak / GIB:.1f} GiB); "
        f"fused kernels: {', '.join(module.updates.fused_kernels) or 'none'}")
    result = {"arm": arm, "steps": report.steps, "estimate_peak_gb": estimate.peak / GIB, "estimate": estimate.table(),
              "engine": type(module.engine).__name__, "kv_cache": getattr(module.engine, "kv_cache", None),
              "attention_order": getattr(module.engine, "attention_order", None),
              "fused_kernels": list(module.updates.fused_kernels),
              "rollout_dtype": str(next(module.engine.senior.parameters()).dtype)}
    del module, trainer
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def estimate_only(model_args: dict, trainer_args: dict, args, root: Path) -> None:
    """The memory estimate of the config's step on each GPU, from shapes alone (models on the meta
    device, rollouts in bf16 as on a GPU); with ``--devices N`` the senior sharded by FSDP2 over N
    GPUs, each rolling out its share of the prompts (``memory.estimate_step_memory``)."""
    from tandem_lit.training.distributed import rank_rows
    from tandem_lit.training.memory import kv_budget

    with torch.device("meta"):
        module = build_module(model_args, "tandem", args, root)
        module.configure_model()
    def estimated():
        return module.memory_estimate(
            prompts_per_step=args.prompts, mixed_precision="mixed" in str(trainer_args.get("precision")),
            decode_dtype=torch.bfloat16, world=args.devices,
        )

    estimate = estimated()
    where = f"each of {args.devices} GPUs (FSDP2)" if args.devices > 1 else "one GPU"
    if pool := module.engine.plan_kv_cache(kv_budget(estimate, H200_BYTES)):  # as fit start sizes it on the device
        print(f"on an H200: {pool}")
        estimate = estimated()
    print(f"estimate for {where}: {estimate.table()}")
    print(f"peak_gb={estimate.peak / GIB:.1f} fits_h200={estimate.peak <= H200_BYTES} devices={args.devices}")
    if args.devices > 1:  # what fit start refuses on several processes (distributed.check_several_processes)
        try:
            rank_rows(args.prompts, args.devices, 0, module.update_settings.mini_batch_size)
        except ValueError:
            print(f"needs on {args.devices} processes: PPO mini-batches of prompts that split over {args.devices} ranks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs/rlvr/qwen3_4b_tandem.yaml"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny test models and the GSM8K sample (CPU check)")
    parser.add_argument("--tokenizer", default=str(REPO.parent / "shared/models/qwen3-tokenizer"))
    parser.add_argument("--problems", default=str(REPO.parent / "shared/data/deepscaler/train/deepscaler_subset_803.json"))
    parser.add_argument("--arms", nargs="+", default=["tandem", "grpo"], choices=["tandem", "grpo", "grpo-vllm"],
                        help="grpo-vllm: the GRPO arm decoded by VLLMEngine (needs the vllm extra and CUDA)")
    parser.add_argument("--engine", choices=["fast", "vllm"], default=None,
                        help="vllm: the GRPO arm decodes with VLLMEngine (same as --arms ... grpo-vllm)")
    parser.add_argument("--vllm-kwargs", default=None,
                        help=f"JSON keyword arguments of VLLMEngine(...) for grpo-vllm (default: the config's engine if it "
                             f"is VLLMEngine, else {VLLM_DEFAULTS}, as in configs/rlvr/qwen3_4b_grpo_vllm.yaml)")
    parser.add_argument("--steps", type=int, default=1, help="measured steps per arm")
    parser.add_argument("--warmup-steps", type=int, default=2, help="short unreported steps first (32 tokens)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the config's data batch_size)")
    parser.add_argument("--n", type=int, default=None, help="rollouts per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--rollout-batch-size", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--mini-batch-size", type=int, default=None)
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    parser.add_argument("--lora", type=int, default=None, help="train LoRA adapters of this rank")
    parser.add_argument("--qlora", action="store_true", help="with --lora: over a 4-bit NF4 base (needs bitsandbytes)")
    parser.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--release-rollout-caches", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--rollout-dtype", default=None, help="the engine's rollout_dtype (default: the config's engine)")
    parser.add_argument("--hf-engine", action="store_true", help="with --rollout-dtype: HFEngine instead of FastEngine")
    parser.add_argument("--kv-cache", default=None, choices=["slots", "paged"],
                        help="FastEngine's KV layout (default: the config's); paged: concurrency bounded by the tokens in "
                             "use, the pool sized by the memory plan, so --rollout-batch-size can grow")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="with --kv-cache paged: the pool's size (default: what the memory plan finds free)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                        help="FastEngine's kv_cache_dtype (default: the config's); fp8: keys and values in 8 bits")
    parser.add_argument("--attention-split", type=int, default=None,
                        help="FastEngine's attention_split: decode attention over chunks of this many slots per program")
    parser.add_argument("--compare-attention-order", action="store_true",
                        help="each FastEngine arm again with its decode attention's programs in row order (attention_order: "
                             "rows), in the same run: the decode step's and rollout's ratio to the default longest-first order")
    parser.add_argument("--compare-fp8", action="store_true",
                        help="also run each arm with FastEngine's 8-bit KV cache (arm+fp8; with the objective's tis_cap 2.0 "
                             "unless the config sets one: fit requires it) and print the ratio of its rollout "
                             "time, decode step and mismatch_kl to the arm's")
    parser.add_argument("--devices", type=int, default=1, help="processes (GPUs); > 1 needs --strategy fsdp")
    parser.add_argument("--strategy", default=None, choices=["fsdp"], help="fsdp: tandem_lit.training.distributed.FSDP2Strategy")
    parser.add_argument("--pack-sequences", action=argparse.BooleanOptionalAction, default=None,
                        help="memory.pack_sequences: packed update passes (default: the config's)")
    parser.add_argument("--fill-passes", action=argparse.BooleanOptionalAction, default=None,
                        help="memory.fill_passes: update passes filled to micro_batch_tokens, not capped at "
                             "micro_batch_size rows (default: the config's)")
    parser.add_argument("--attn-implementation", default=None, choices=["sdpa", "eager", "flex_attention", "flash_attention_2"],
                        help="the senior's attention in the update (default: transformers'); with --pack-sequences, "
                             "sdpa runs PyTorch's variable-length flash kernel (models.varlen_attention)")
    parser.add_argument("--fused-kernels", default=None, choices=["auto", "liger", "off"],
                        help="memory.fused_kernels: Liger-Kernel's kernels in the update (default: the config's, auto)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="the device's dense bf16 TFLOP/s, for the update's MFU")
    parser.add_argument("--logp-gap-limit", type=float, default=None,
                        help="update.logp_gap_limit (default: none, so the step is measured and its gap reported)")
    parser.add_argument("--estimate-only", action="store_true")
    parser.add_argument("--lengths", default="fixed",
                        help="fixed (every rollout runs max_new_tokens), or lognormal[:median=1000,sigma=0.8,cap=3000]: "
                             "each rollout's length drawn from its seed (the long tail of real RL responses)")
    parser.add_argument("--partial", type=int, default=None, metavar="IN_FLIGHT",
                        help="also run each arm with rollout.partial (IN_FLIGHT prompt groups in flight; docs/partial_rollouts.md) "
                             "and print the ratio of its rollout time to today's")
    parser.add_argument("--partial-only", action="store_true",
                        help="with --partial: run only the partial arms (today's measured in an earlier run on the machine)")
    parser.add_argument("--keep-caches", nargs="+", default=["none"], choices=["none", "junior", "both"],
                        help="with --partial: one partial arm per rollout.partial.keep_caches value given (both: with "
                             "the objective's tis_cap 2.0, which it requires)")
    parser.add_argument("--max-staleness", type=int, default=2,
                        help="with --partial: rollout.partial.max_staleness (at least the updates a step makes: 2 in the 4B configs)")
    parser.add_argument("--switch-scoring", nargs="+", default=["as-drawn"], choices=["as-drawn", "unrestricted"],
                        help="unrestricted: the trainer scores switch tokens under the unrestricted distribution, as "
                             "before issue 51's fix, against the engine's as-drawn log-probs (mismatch_kl measures the fix); "
                             "given both, each arm runs twice, as drawn then unrestricted (named ARM+unrestricted)")
    parser.add_argument("--dump-logprobs", default=None, metavar="FILE",
                        help="write every update pass's rows with the engine's and the training forward's log-probs "
                             "to FILE.<arm>.pt (to take a log-prob gap apart offline)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--profile-update", default=None, metavar="FILE",
                        help="torch.profiler over the first measured step's update: kernel and host-op tables (CUDA)")
    args = parser.parse_args()
    if args.engine == "vllm":
        args.arms = ["grpo-vllm" if arm == "grpo" else arm for arm in args.arms]
    if "grpo-vllm" in args.arms:
        from tandem_lit.errors import MissingDependencyError
        from tandem_lit.rollout.vllm_engine import import_vllm

        try:
            import_vllm()
        except MissingDependencyError as error:  # before any model is built: one line, not a traceback an arm later
            parser.error(str(error))

    if args.partial_only and not args.partial:
        parser.error("--partial-only runs the partial arms: give --partial IN_FLIGHT")
    config = yaml.safe_load(Path(args.config).read_text())
    model_args, trainer_args = config["model"]["init_args"], config.get("trainer", {})
    if args.tiny:
        args.device = "cpu"
        model_args = dict(model_args, senior={"path": "configs/tiny/senior", "random_init": True, "dtype": "float32"},
                          junior={"path": "configs/tiny/junior", "random_init": True, "dtype": "float32", "init_seed": 1},
                          rollout=dict(model_args["rollout"], prompt_format={"chat_template": False}, max_prompt_tokens=None))
        trainer_args = {"precision": "32-true"}
        args.problems = str(REPO / "data/gsm8k-sample/train.jsonl")
        args.prompts = args.prompts or 2
        args.n = args.n or 2
        args.max_new_tokens = args.max_new_tokens or 8
    args.prompts = args.prompts or config.get("data", {}).get("init_args", {}).get("batch_size", 16)
    with tempfile.TemporaryDirectory() as tmp:
        # one folder for every rank: Lightning starts ranks > 0 by running this script again, with
        # rank 0's environment (each would otherwise write into a temporary folder of its own)
        root = Path(os.environ.setdefault("TANDEM_LIT_BENCHMARK_FOLDER", tmp))
        if args.estimate_only:
            estimate_only(model_args, trainer_args, args, root)
            return
        bandwidth = copy_bandwidth(args.device) if args.device == "cuda" else float("nan")
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        say(f"# {args.config} on {device_name} x {args.devices} ({args.strategy or 'one process'}); copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.prompts} prompts x "
              f"n={args.n or model_args['rollout']['sampling']['n']} x {args.max_new_tokens or model_args['rollout']['sampling']['max_new_tokens']} "
              f"tokens; lora={args.lora or (model_args.get('lora') or {}).get('r')}")  # --lora's rank, or the config's
        arms = [name for arm in args.arms
                for name in ([] if args.partial_only else [arm]) + (partial_arms(arm, args.keep_caches) if args.partial else [])]
        if args.compare_fp8:  # each arm as configured, then with the 8-bit cache, one after the other
            arms = [name for arm in arms for name in (arm, arm + FP8)]
        if args.compare_attention_order:  # ... then with the attention's programs in row order
            arms = [name for arm in arms for name in (arm, arm + ROWS)]
        scorings = ["", UNRESTRICTED] if set(args.switch_scoring) == {"as-drawn", "unrestricted"} else [""]
        arms = [arm + scoring for arm in arms for scoring in scorings]
        results = {arm: run_arm(arm, model_args, trainer_args, args, root, bandwidth) for arm in arms}
    if not rank_zero():
        return  # rank 0 writes the results
    if args.partial:
        def rollout_seconds(arm):  # mean over the measured steps: carried groups make a step's rollout differ from the next
            return sum(s["rollout_seconds"] for s in results[arm]["steps"]) / len(results[arm]["steps"])

        for arm in args.arms:
            arms = partial_arms(arm, args.keep_caches)
            base = arm if not args.partial_only else arms[0] if len(arms) > 1 else None
            for name in (a for a in arms if a != base and base is not None):
                label = name.removeprefix(arm).replace("+", "_")
                over = "today" if base == arm else "partial"
                print(f"{arm}{label}_over_{over}_rollout={rollout_seconds(name) / rollout_seconds(base):.2f} (in flight "
                      f"{args.partial}, max_staleness {args.max_staleness}; mean over {args.steps} measured steps)")
    if args.compare_fp8:
        for arm in (a for a in results if a + FP8 in results):
            auto, fp8 = (results[a]["steps"] for a in (arm, arm + FP8))
            print(f"{arm}_fp8_over_auto_rollout={mean_over_steps(fp8, 'rollout_seconds') / mean_over_steps(auto, 'rollout_seconds'):.2f} "
                  f"decode_step={mean_over_steps(fp8, 'decode_step_ms') / mean_over_steps(auto, 'decode_step_ms'):.2f} "
                  f"mismatch_kl {mean_over_steps(auto, 'mismatch_kl'):.3g} -> {mean_over_steps(fp8, 'mismatch_kl'):.3g}")
    if args.compare_attention_order:
        for arm in (a for a in results if a.endswith(ROWS)):
            ordered, rows = (results[a]["steps"] for a in (arm.removesuffix(ROWS), arm))
            print(f"{arm.removesuffix(ROWS)}_rows_over_longest_first_decode_step="
                  f"{mean_over_steps(rows, 'decode_step_ms') / mean_over_steps(ordered, 'decode_step_ms'):.2f} "
                  f"rollout={mean_over_steps(rows, 'rollout_seconds') / mean_over_steps(ordered, 'rollout_seconds'):.2f}")
    if len(scorings) == 2:
        for arm in (a for a in results if a + UNRESTRICTED in results):
            drawn, unrestricted = (results[a]["steps"] for a in (arm, arm + UNRESTRICTED))
            print(f"{arm}_mismatch_kl as_drawn={mean_over_steps(drawn, 'mismatch_kl'):.3g} "
                  f"unrestricted={mean_over_steps(unrestricted, 'mismatch_kl'):.3g} (mean over {args.steps} measured steps)")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "device": device_name, "bandwidth": bandwidth,
                                               "args": vars(args), "arms": results}, indent=2))
    peak = max(s["peak_gb"] for r in results.values() for s in r["steps"])
    if {arm.removesuffix(PARTIAL) for arm in results} == {"tandem", "grpo"}:
        tandem, grpo = (min(results[a]["steps"], key=lambda s: s["step_seconds"]) for a in ("tandem", "grpo"))
        bytes_ratio = tandem["roofline_ms"] / grpo["roofline_ms"]
        ideal = (grpo["rollout_seconds"] * bytes_ratio + grpo["update_seconds"]) / (grpo["rollout_seconds"] + grpo["update_seconds"])
        print(f"tandem_over_grpo_step={tandem['step_seconds'] / grpo['step_seconds']:.2f} ideal={ideal:.2f} peak_gb={peak:.1f}")
    elif {"grpo", "grpo-vllm"} <= set(results):
        fast, vllm = (min(results[a]["steps"], key=lambda s: s["step_seconds"]) for a in ("grpo", "grpo-vllm"))
        print(f"vllm_over_fast_grpo_step={vllm['step_seconds'] / fast['step_seconds']:.2f} "
              f"rollout={vllm['rollout_seconds'] / fast['rollout_seconds']:.2f} peak_gb={peak:.1f}")
    else:
        arm = next(iter(results.values()))
        print(f"{arm['arm']}_step_seconds={min(s['step_seconds'] for s in arm['steps']):.1f} peak_gb={peak:.1f}")


if __name__ == "__main__":
    main()
