"""Rollout throughput: naive two-model HF loop vs HF generate vs FastEngine (solo, tandem).

GPU (H200), Qwen3-4B senior and Qwen3-1.7B junior shapes with random bf16 weights, EOS
ignored so every sequence runs the full budget, word-level handoff p=0.5:

    python benchmarks/rollout.py --device cuda --batches 16 64 256 --new-tokens 256 1024

CPU micro-benchmark with tiny models (CI-sized machines can see regressions):

    python benchmarks/rollout.py --device cpu --tiny

Qwen3.5's hybrid attention (Gated DeltaNet + full attention), 9B / 2B shapes:

    python benchmarks/rollout.py --device cuda --models qwen35-9b-2b --batches 16 64 --new-tokens 256

Long-tailed response lengths (what RL rollouts look like; random weights never end, so each
sequence gets a budget from one seeded lognormal draw shared by every engine): ``--queue`` x
batch sequences per call, at most ``batch`` decoding at once; the static path runs them in
chunks of ``batch``, each to its longest sequence, the continuous path as one queue. Reports
useful tokens/s (sum of budgets / wall time) and ``continuous_over_static``:

    python benchmarks/rollout.py --device cuda --batches 64 --lengths lognormal:median=1000,sigma=0.8,cap=3000
    python benchmarks/rollout.py --device cpu --tiny --lengths lognormal

``--kv-cache slots paged`` times the continuous rows with each KV layout in the same run (the
paged pool as large as the slot caches unless ``--kv-cache-gib`` sizes it; ``--kv-page-size``),
reports each row's peak GPU memory, the pool's preemptions and peak use, and ``paged_over_slots``:

    python benchmarks/rollout.py --device cuda --batches 64 128 --lengths lognormal --kv-cache slots paged

``--vllm`` adds vLLM (solo senior; ``tandem_lit.rollout.vllm_engine.VLLMEngine``), each engine in its
own subprocess (vLLM holds GPU memory), and prints ``fast_over_vllm``:

    python benchmarks/rollout.py --device cuda --batches 64 --lengths lognormal --vllm

Every row is measured in the same run; ratios compare rows of that run only. The roofline is
the bytes one decode step must read (both models' weights + the KV cache at the mean length)
divided by the copy bandwidth measured in the same run; for hybrid models also the
linear-attention states each step reads and writes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import SoloHandoff, WordHandoff
from tandem_lit.rollout.record import PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.static import FastEngine

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128)
QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128)
# Qwen3.5 (hybrid: 3 Gated DeltaNet layers per gated full-attention layer). 9B: transformers'
# Qwen3_5TextConfig defaults ("Qwen3.5-9B style"). 2B: hidden size 2048 as published; the other
# sizes are our assumption (no config of it on this machine), scaled like the 9B's.
QWEN35_9B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False)
QWEN35_2B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True)
TINY_SENIOR = dict(hidden_size=96, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=24)
TINY_JUNIOR = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)


def synthetic_tokenizer(vocab_size: int):
    """A real fast tokenizer with ``vocab_size`` tokens; about a third start a word (leading space),
    a few are line breaks, so word boundaries occur at a realistic rate."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), vocab_size):
        vocab[("\n" if i % 97 == 0 else " " if i % 3 == 0 else "") + f"w{i}"] = i
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_qwen3(shape: dict, vocab: int, dtype: torch.dtype, device: str, seed: int) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, max_position_embeddings=40960, rope_theta=1_000_000.0,
                         tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, bos_token_id=1, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def build_qwen35(shape: dict, vocab: int, dtype: torch.dtype, device: str, seed: int) -> nn.Module:
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(vocab_size=vocab, eos_token_id=2, pad_token_id=0, bos_token_id=1, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def weight_bytes(model: nn.Module) -> int:
    # a tied embedding is read once per step (as the LM head); an untied input embedding only
    # for the B rows looked up, so it is not counted
    params = {id(p): p for p in model.parameters()}
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        params.pop(id(embedding))
    return sum(p.numel() * p.element_size() for p in params.values())


def full_attention_layers(config) -> int:
    types = getattr(config, "layer_types", None)
    return types.count("full_attention") if types else config.num_hidden_layers


def kv_bytes_per_token(model: nn.Module) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return full_attention_layers(c) * 2 * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def state_bytes_per_sequence(model: nn.Module) -> int:
    """Linear-attention state one decode step reads and writes per sequence (read + write counted):
    the float32 delta-rule state and the convolution window of every linear-attention layer."""
    c = model.config
    types = getattr(c, "layer_types", None) or []
    layers = types.count("linear_attention")
    if not layers:
        return 0
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    conv = conv_dim * c.linear_conv_kernel_dim * next(model.parameters()).element_size()
    return 2 * layers * (recurrent + conv)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    if device != "cuda":
        return float("nan")
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    del x, y
    return 2 * 2 * 1024**3 / seconds


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class Row:
    name: str
    batch: int
    new_tokens: int
    steps: int
    seconds: float
    phases: dict | None = None  # FastEngine.last_timing() of the last timed run: prefill vs decode

    @property
    def tokens_per_second(self) -> float:
        return self.batch * self.steps / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps


def time_engine(engine, prompts, policy, sampling, device, repeats: int) -> tuple[float, dict | None]:
    engine.generate(prompts, policy, sampling)  # warm-up: graph capture, allocator growth, lazy init
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = engine.generate(prompts, policy, sampling)
        sync(device)
        times.append(time.perf_counter() - start)
        assert int(out.lengths.min()) == sampling.max_new_tokens, "EOS must be ignored in the benchmark"
    timing = engine.last_timing()
    return statistics.median(times), timing.as_dict() if timing is not None else None


def time_hf_generate(model, prompts, sampling, device, repeats: int) -> float:
    kwargs = dict(attention_mask=prompts.attention_mask, max_new_tokens=sampling.max_new_tokens,
                  min_new_tokens=sampling.max_new_tokens, do_sample=True, temperature=sampling.temperature,
                  top_k=0, top_p=1.0, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompts.input_ids, **kwargs)  # warm-up
        times = []
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            model.generate(prompts.input_ids, **kwargs)
            sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def parse_lengths(spec: str, tiny: bool) -> dict | None:
    """``fixed`` -> None; ``lognormal[:median=M,sigma=S,cap=C]`` -> its parameters (tiny models:
    defaults scaled to a CPU-sized run)."""
    if spec == "fixed":
        return None
    kind, _, rest = spec.partition(":")
    if kind != "lognormal":
        raise SystemExit(f"--lengths must be 'fixed' or 'lognormal[:median=..,sigma=..,cap=..]', got {spec!r}")
    params = {"median": 24.0, "sigma": 0.8, "cap": 64.0} if tiny else {"median": 1000.0, "sigma": 0.8, "cap": 3000.0}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in params:
            raise SystemExit(f"unknown --lengths parameter {key!r} (median, sigma, cap)")
        params[key] = float(value)
    params["cap"] = int(params["cap"])
    return params


def draw_budgets(params: dict, count: int, seed: int) -> torch.Tensor:
    """One seeded lognormal draw of per-sequence token budgets in [1, cap]: the same for every engine."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(count, generator=generator, dtype=torch.float64)
    lengths = torch.exp(math.log(params["median"]) + params["sigma"] * normal).round()
    return lengths.clamp(1, params["cap"]).long()


def timed(generate, prompts, device, repeats: int):
    generate(prompts)  # warm-up: graph capture, allocator growth, lazy init
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = generate(prompts)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def useful_rows(args, part: str) -> list[dict]:
    """The long-tailed comparison's rows for ``part`` (fast: static and continuous FastEngine;
    vllm: vLLM), one dict per row."""
    device = args.device
    if args.tiny:
        shapes, vocab, dtype = (TINY_SENIOR, TINY_JUNIOR), 512, torch.float32
        batches, prompt_len, repeats = args.batches or [8], args.prompt or 32, args.repeats or 3
        torch.set_num_threads(1)  # tiny matrices: threads only add contention noise on a shared CPU
    else:
        shapes, vocab, dtype = (QWEN3_4B, QWEN3_1_7B), 151936, torch.bfloat16
        batches, prompt_len, repeats = args.batches or [64], args.prompt or 128, args.repeats or 1
        if args.models == "qwen35-9b-2b":
            shapes, vocab = (QWEN35_9B, QWEN35_2B), 248320
        elif args.models == "qwen3-4b-4b":
            shapes = (QWEN3_4B, QWEN3_4B)
    params = parse_lengths(args.lengths, args.tiny) or {"cap": (args.new_tokens or [64 if args.tiny else 1024])[0]}
    cap = params["cap"]
    tokenizer = synthetic_tokenizer(vocab)
    build = build_qwen35 if args.models == "qwen35-9b-2b" and not args.tiny else build_qwen3
    senior = build(shapes[0], vocab, dtype, device, seed=0)
    junior = build(shapes[1], vocab, dtype, device, seed=1) if part == "fast" else None
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=cap, ignore_eos=True)
    if part == "vllm":
        from tandem_lit.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(**json.loads(args.vllm_kwargs))
    else:
        engine = FastEngine(kv_page_size=args.kv_page_size)
    engine.setup(senior, junior, tokenizer)
    rows = []

    def keep(r: dict) -> None:  # each row as soon as it is measured: a run cut short keeps what it did
        rows.append(r)
        print(f"# measured: {r['name']}, batch {r['batch']}: {r['useful_tokens_per_second']:,.0f} useful tok/s",
              file=sys.stderr, flush=True)

    for batch in batches:
        sequences = batch * args.queue
        budgets = draw_budgets(params, sequences, args.length_seed) if "median" in params else torch.full((sequences,), cap)
        ids = torch.randint(4, vocab, (sequences, prompt_len), generator=torch.Generator().manual_seed(batch))
        prompts = PromptBatch(ids, torch.ones_like(ids), sequence_seeds(0, 0, sequences), None, budgets).to(device)
        useful = int(budgets.sum())

        def row(name, seconds, out, timing=None, batch=batch, sequences=sequences, useful=useful, budgets=budgets):
            assert out.lengths.cpu().tolist() == budgets.tolist(), "every sequence must run exactly its budget"
            return {"name": name, "batch": batch, "sequences": sequences, "useful_tokens": useful, "seconds": seconds,
                    "useful_tokens_per_second": useful / seconds, **(timing or {})}

        if part == "vllm":
            seconds, out = timed(lambda p: engine.generate(p, SoloHandoff("senior"), sampling), prompts, device, repeats)
            keep(row("vLLM, solo", seconds, out))
            continue

        for policy_name, policy in [(n, p) for n, p in (("solo", SoloHandoff()), ("tandem", WordHandoff(0.5)))
                                    if n in args.policies]:
            # static: calls of `batch` rows, each runs until its longest sequence ends (the cost of
            # a static batch); the useful tokens are the same budgets
            engine.max_batch = None

            def static(p, policy=policy, batch=batch):
                outs = []
                for start in range(0, p.batch_size, batch):
                    chunk = p.select(list(range(start, min(start + batch, p.batch_size))))
                    longest = chunk.max_new_tokens.max().expand_as(chunk.max_new_tokens)
                    chunk = PromptBatch(chunk.input_ids, chunk.attention_mask, chunk.seeds, None, longest)
                    outs.append(engine.generate(chunk, policy, sampling))
                return outs

            if not args.skip_static:
                set_kv_layout(engine, "slots", None)  # the static baseline keeps the slot caches
                seconds, outs = timed(static, prompts, device, repeats)
                keep({"name": f"FastEngine static, {policy_name}", "batch": batch, "sequences": sequences,
                      "useful_tokens": useful, "seconds": seconds, "useful_tokens_per_second": useful / seconds,
                      "steps": sum(int(o.lengths.max()) for o in outs)})
            engine.max_batch = batch
            for layout in args.kv_cache:
                set_kv_layout(engine, layout, args.kv_cache_gib)
                for kv_dtype in args.kv_cache_dtype:
                    if engine.kv_cache_dtype != kv_dtype:
                        engine.release()  # the caches are re-allocated in the new dtype
                        engine.kv_cache_dtype = kv_dtype
                    for refill in args.refill:
                        for overlap in args.overlap_prefill:
                            engine.refill, engine.overlap_prefill = refill, overlap
                            reset_peak_memory(device)
                            seconds, out = timed(lambda p, policy=policy: engine.generate(p, policy, sampling), prompts, device, repeats)
                            keep(row(continuous_name(layout, refill, policy_name, overlap, kv_dtype), seconds, out,
                                     {**engine.last_timing().as_dict(), **peak_memory(device)}))
        engine.release()  # the next batch size sizes its own caches
    return rows


def continuous_name(layout: str, refill: str, policy: str, overlap: str = "off", kv_dtype: str = "auto") -> str:
    return (f"FastEngine continuous{' paged' if layout == 'paged' else ''}{' fp8 KV' if kv_dtype == 'fp8' else ''}"
            f"{' eager refill' if refill == 'eager' else ''}{' overlapped prefill' if overlap == 'on' else ''}, {policy}")


def set_kv_layout(engine: FastEngine, layout: str, gib: float | None) -> None:
    """Switch the engine's KV layout (its caches are freed and re-allocated by the next call)."""
    pool_gib = gib if layout == "paged" else None
    if (engine.kv_cache, engine.kv_cache_gib) != (layout, pool_gib):
        engine.release()
        engine.kv_cache, engine.kv_cache_gib = layout, pool_gib


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> dict:
    return {"peak_gib": torch.cuda.max_memory_allocated() / 1024**3} if device == "cuda" else {}


def print_useful(rows: list[dict]) -> None:
    print(f"{'batch':>5} {'seqs':>5} {'row':<38} {'useful tok':>10} {'seconds':>8} {'useful tok/s':>12} "
          f"{'busy':>6} {'refills':>7} {'compact':>7} {'prefill s':>9} {'peak GiB':>8} {'preempt':>7} {'pool tok':>8} "
          f"{'pool use':>8}")
    for r in rows:
        busy = f"{r['busy_slot_fraction']:>6.1%}" if "busy_slot_fraction" in r else f"{'':>6}"
        counts = f"{r['refills']:>7} {r['compactions']:>7} {r['prefill_s']:>9.2f}" if "refills" in r else ""
        peak = f" {r['peak_gib']:>8.1f}" if "peak_gib" in r else (f" {'':>8}" if "refills" in r else "")
        pool = (f" {r['preemptions']:>7} {r['kv_pool_tokens']:>8} {r['kv_pool_peak_fraction']:>8.1%}"
                if "preemptions" in r else "")
        print(f"{r['batch']:>5} {r['sequences']:>5} {r['name']:<38} {r['useful_tokens']:>10} {r['seconds']:>8.2f} "
              f"{r['useful_tokens_per_second']:>12.0f} {busy} {counts}{peak}{pool}")


def useful_main(args) -> None:
    params = parse_lengths(args.lengths, args.tiny)
    print(f"# device={args.device} lengths={args.lengths} {params or ''} queue={args.queue}x batch, "
          f"length seed {args.length_seed}")
    if args.vllm and args.only is None:
        rows = []
        for part in ("fast", "vllm"):  # one process each: vLLM holds GPU memory for its life
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--only", part],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout + done.stderr[-4000:], file=sys.stderr)
                if rows:  # what the other engine measured is still a result: show it before failing
                    print_useful(rows)
                raise SystemExit(f"the {part} subprocess failed")
            result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            rows.extend(json.loads(result[-1][len("RESULT "):]))
    else:
        rows = useful_rows(args, args.only or "fast")
        if args.only is not None:
            print("RESULT " + json.dumps(rows))
            return
    print_useful(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "lengths": args.lengths, "rows": rows}, f, indent=2)

    def rate(name: str, batch: int) -> float:
        return next(r["useful_tokens_per_second"] for r in rows if r["name"] == name and r["batch"] == batch)

    batch = rows[0]["batch"]
    layout = "slots" if "slots" in args.kv_cache else "paged"
    kv0 = args.kv_cache_dtype[0]
    continuous = continuous_name(layout, args.refill[0], "", args.overlap_prefill[0], kv0)[:-2]
    parts = []
    suffix = {"tandem": "", "solo": "_solo"}
    if not args.skip_static:
        parts += [f"continuous_over_static{suffix[p]}={rate(f'{continuous}, {p}', batch) / rate(f'FastEngine static, {p}', batch):.2f}"
                  for p in ("tandem", "solo") if p in args.policies]
    if args.vllm:
        parts.append(f"fast_over_vllm={rate(f'{continuous}, solo', batch) / rate('vLLM, solo', batch):.2f}")
    if set(args.kv_cache) == {"slots", "paged"}:  # every batch size: the layouts' throughput, same run
        for b in sorted({r["batch"] for r in rows}):
            for policy in [p for p in ("tandem", "solo") if p in args.policies]:
                ratio = (rate(continuous_name("paged", args.refill[0], policy, args.overlap_prefill[0], kv0), b)
                         / rate(continuous_name("slots", args.refill[0], policy, args.overlap_prefill[0], kv0), b))
                parts.append(f"paged_over_slots{'' if policy == 'tandem' else '_solo'}_b{b}={ratio:.3f}")
    if set(args.overlap_prefill) == {"on", "off"}:  # prefills beside decode chunks vs waited for, same run
        for b in sorted({r["batch"] for r in rows}):
            for policy in [p for p in ("tandem", "solo") if p in args.policies]:
                ratio = (rate(continuous_name(layout, args.refill[0], policy, "on", kv0), b)
                         / rate(continuous_name(layout, args.refill[0], policy, "off", kv0), b))
                parts.append(f"overlapped_over_waiting_prefill{'' if policy == 'tandem' else '_solo'}_b{b}={ratio:.3f}")
    if set(args.refill) == {"amortized", "eager"}:  # the refill timer's worth, same run
        for b in sorted({r["batch"] for r in rows}):
            for policy in [p for p in ("tandem", "solo") if p in args.policies]:
                ratio = (rate(continuous_name(layout, "amortized", policy, args.overlap_prefill[0], kv0), b)
                         / rate(continuous_name(layout, "eager", policy, args.overlap_prefill[0], kv0), b))
                parts.append(f"amortized_over_eager_refill{'' if policy == 'tandem' else '_solo'}_b{b}={ratio:.3f}")
    if set(args.kv_cache_dtype) == {"auto", "fp8"}:  # 8-bit keys and values against the model's dtype, same run
        for b in sorted({r["batch"] for r in rows}):
            for policy in [p for p in ("tandem", "solo") if p in args.policies]:
                ratio = (rate(continuous_name(layout, args.refill[0], policy, args.overlap_prefill[0], "fp8"), b)
                         / rate(continuous_name(layout, args.refill[0], policy, args.overlap_prefill[0], "auto"), b))
                parts.append(f"fp8_over_auto_kv{'' if policy == 'tandem' else '_solo'}_b{b}={ratio:.3f}")
    print(" ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models (CPU regression check)")
    parser.add_argument("--models", choices=["qwen3-4b-1.7b", "qwen3-4b-4b", "qwen35-9b-2b"], default="qwen3-4b-1.7b",
                        help="model shapes: Qwen3-4B/1.7B, Qwen3-4B/4B (the self-paired tandem), or Qwen3.5-9B/2B (hybrid linear + full attention)")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens")
    parser.add_argument("--baseline-steps", type=int, default=256,
                        help="cap on the baselines' new tokens (they are slow); their tokens/s is measured at that length")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--compare-overlap", action="store_true",
                        help="also time tandem with the junior forward on the main stream (FastEngine(overlap_junior=False)) "
                             "and check both give the same rollouts")
    parser.add_argument("--lengths", default="fixed",
                        help="fixed (every sequence runs --new-tokens), or lognormal[:median=1000,sigma=0.8,cap=3000]: "
                             "per-sequence budgets, static vs continuous batching, useful tokens/s")
    parser.add_argument("--queue", type=int, default=4, help="with --lengths/--vllm: sequences per call = queue x batch")
    parser.add_argument("--length-seed", type=int, default=0, help="seed of the budget draw (shared by every engine)")
    parser.add_argument("--vllm", action="store_true", help="also measure vLLM (solo), each engine in its own process")
    parser.add_argument("--vllm-kwargs", default="{}", help="JSON keyword arguments of VLLMEngine(...)")
    parser.add_argument("--kv-cache", nargs="+", choices=["slots", "paged"], default=["slots"],
                        help="with --lengths: the KV layouts of the continuous rows, each timed in the same run")
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "fp8"], default=["auto"],
                        help="FastEngine(kv_cache_dtype=...): continuous rows for each (fp8: 8-bit keys and values)")
    parser.add_argument("--kv-page-size", type=int, default=64, help="positions per page of the paged KV pool")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="size of the paged pool (default: as large as the slot caches, so nothing is preempted)")
    parser.add_argument("--refill", nargs="+", choices=["amortized", "eager"], default=["amortized"],
                        help="FastEngine(refill=...): continuous rows for each (the first sets the ratios' row)")
    parser.add_argument("--overlap-prefill", nargs="+", choices=["on", "off"], default=["off"],
                        help="FastEngine(overlap_prefill=...): refills prefilled beside the next decode chunk, or "
                             "waited for; continuous rows for each (the first sets the ratios' row)")
    parser.add_argument("--policies", nargs="+", choices=["solo", "tandem"], default=["solo", "tandem"],
                        help="with --lengths: the continuous/static rows of these (the ratios need both)")
    parser.add_argument("--skip-static", action="store_true", help="with --lengths: leave out the static-batch rows")
    parser.add_argument("--only", choices=["fast", "vllm"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lengths != "fixed" or args.vllm:
        useful_main(args)
        return

    device = args.device
    if args.tiny:
        shapes, vocab, dtype = (TINY_SENIOR, TINY_JUNIOR), 512, torch.float32
        batches, new_tokens, prompt_len, repeats = args.batches or [16], args.new_tokens or [64], args.prompt or 32, args.repeats or 3
        torch.set_num_threads(max(1, torch.get_num_threads()))
    elif args.models == "qwen35-9b-2b":
        shapes, vocab, dtype = (QWEN35_9B, QWEN35_2B), 248320, torch.bfloat16
        batches, new_tokens, prompt_len, repeats = args.batches or [16, 64], args.new_tokens or [256], args.prompt or 128, args.repeats or 1
    else:
        shapes, vocab, dtype = (QWEN3_4B, QWEN3_4B if args.models == "qwen3-4b-4b" else QWEN3_1_7B), 151936, torch.bfloat16
        batches, new_tokens, prompt_len, repeats = args.batches or [16, 64, 256], args.new_tokens or [256, 1024], args.prompt or 128, args.repeats or 1
    tokenizer = synthetic_tokenizer(vocab)
    build = build_qwen35 if args.models == "qwen35-9b-2b" and not args.tiny else build_qwen3
    senior = build(shapes[0], vocab, dtype, device, seed=0)
    junior = build(shapes[1], vocab, dtype, device, seed=1)
    naive, fast = HFEngine(), FastEngine()
    naive.setup(senior, junior, tokenizer)
    fast.setup(senior, junior, tokenizer)
    bandwidth = copy_bandwidth(device)
    senior_w, junior_w = weight_bytes(senior), weight_bytes(junior)
    senior_kv, junior_kv = kv_bytes_per_token(senior), kv_bytes_per_token(junior)
    senior_state, junior_state = state_bytes_per_sequence(senior), state_bytes_per_sequence(junior)
    name = "tiny" if args.tiny else {"qwen35-9b-2b": "Qwen3.5-9B / Qwen3.5-2B shapes", "qwen3-4b-4b": "Qwen3-4B / Qwen3-4B (self-paired) shapes"}.get(
        args.models, "Qwen3-4B / Qwen3-1.7B shapes")
    print(f"# device={device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}) models={name} dtype={dtype}")
    print(f"# weights: senior {senior_w / 1e9:.2f} GB, junior {junior_w / 1e9:.2f} GB; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if senior_state or junior_state:
        print(f"# linear-attention state read+written per sequence per step: senior {senior_state / 1e6:.1f} MB, "
              f"junior {junior_state / 1e6:.1f} MB")
    header = (f"{'batch':>5} {'new':>5} {'row':<28} {'steps':>5} {'ms/step':>8} {'tok/s':>9} {'roofline':>8} "
              f"{'prefill ms':>10} {'decode ms/step':>14} {'decode roofline':>15}")
    print(header)
    results = []
    summary = {}
    for new in new_tokens:
        for batch in batches:
            generator = torch.Generator().manual_seed(batch)
            ids = torch.randint(4, vocab, (batch, prompt_len), generator=generator)
            prompts = PromptBatch(ids, torch.ones_like(ids), sequence_seeds(0, 0, batch)).to(device)
            full = SamplingConfig(temperature=args.temperature, max_new_tokens=new, ignore_eos=True)
            short = SamplingConfig(temperature=args.temperature, max_new_tokens=min(new, args.baseline_steps), ignore_eos=True)
            rows = [
                Row("naive HF loop, tandem", batch, new, short.max_new_tokens,
                    *time_engine(naive, prompts, WordHandoff(0.5), short, device, repeats)),
                Row("HF generate, solo", batch, new, short.max_new_tokens, time_hf_generate(senior, prompts, short, device, repeats)),
                Row("FastEngine, solo", batch, new, new, *time_engine(fast, prompts, SoloHandoff(), full, device, repeats)),
                Row("FastEngine, tandem", batch, new, new, *time_engine(fast, prompts, WordHandoff(0.5), full, device, repeats)),
            ]
            if args.compare_overlap:  # the same engine (one set of caches), junior on the main stream
                fast.overlap_junior = False
                rows.append(Row("FastEngine, tandem, 1 stream", batch, new, new,
                                *time_engine(fast, prompts, WordHandoff(0.5), full, device, repeats)))
                serial = fast.generate(prompts, WordHandoff(0.5), full)
                fast.overlap_junior = True
            mean_len = prompt_len + new / 2
            step_bytes = {
                "solo": senior_w + batch * (mean_len * senior_kv + senior_state),
                "tandem": senior_w + junior_w + batch * (mean_len * (senior_kv + junior_kv) + senior_state + junior_state),
            }
            measured_rows = []
            for row in rows:
                kind = "solo" if "solo" in row.name else "tandem"
                roofline_tps = batch / (step_bytes[kind] / bandwidth) if bandwidth == bandwidth else float("nan")
                share = row.tokens_per_second / roofline_tps
                # the roofline is per decode step; end-to-end tokens/s also pays the prompts' prefill
                # (compute-bound, once per batch), so the decode step alone is shown against it too
                extra = {}
                if row.phases:
                    extra = {"prefill_ms": 1000 * row.phases["prefill_s"], "decode_step_ms": row.phases["decode_step_ms"],
                             "decode_roofline_share": 1000 * step_bytes[kind] / bandwidth / row.phases["decode_step_ms"]}
                decode = (f"{extra['prefill_ms']:>10.1f} {extra['decode_step_ms']:>14.2f} {extra['decode_roofline_share']:>15.1%}"
                          if extra else "")
                print(f"{batch:>5} {new:>5} {row.name:<28} {row.steps:>5} {row.step_ms:>8.2f} {row.tokens_per_second:>9.0f} "
                      f"{share:>8.1%} {decode}")
                measured_rows.append({**row.__dict__, "tokens_per_second": row.tokens_per_second, "step_ms": row.step_ms,
                                      "roofline_tokens_per_second": roofline_tps, "roofline_share": share, **extra})
            results.extend(measured_rows)
            naive_row, _, solo_row, tandem_row = rows[:4]
            tandem_result = measured_rows[3]
            ideal = step_bytes["tandem"] / step_bytes["solo"]
            measured = tandem_row.step_ms / solo_row.step_ms
            decode_ratio = tandem_row.phases["decode_step_ms"] / solo_row.phases["decode_step_ms"]
            key = f"b{batch}_n{new}"
            summary[key] = {
                "tandem_vs_naive": tandem_row.tokens_per_second / naive_row.tokens_per_second,
                "tandem_over_solo_step": measured,
                "tandem_over_solo_decode_step": decode_ratio,
                "ideal_tandem_over_solo": ideal,
                "tandem_roofline_share": tandem_result["roofline_share"],
                "tandem_decode_roofline_share": tandem_result["decode_roofline_share"],
            }
            if args.compare_overlap:
                a, b = fast.generate(prompts, WordHandoff(0.5), full), serial
                same = all(torch.equal(getattr(a, f), getattr(b, f))
                           for f in ("completion_ids", "author", "senior_logprobs", "handoffs"))
                summary[key]["overlap_speedup"] = rows[4].seconds / tandem_row.seconds
                summary[key]["overlap_same_rollouts"] = same
                print(f"{'':>11} overlap: {summary[key]['overlap_speedup']:.3f}x faster than 1 stream; same rollouts: {same}")
            print(f"{'':>11} tandem/naive {summary[key]['tandem_vs_naive']:.1f}x; tandem/solo step {measured:.2f} end to end, "
                  f"{decode_ratio:.2f} decode (ideal {ideal:.2f}, decode {decode_ratio / ideal - 1:+.1%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "models": name, "bandwidth": bandwidth, "rows": results, "summary": summary}, f, indent=2)
    first = next(iter(summary.values()))
    print(f"tandem_vs_naive={first['tandem_vs_naive']:.2f} tandem_over_solo_step={first['tandem_over_solo_step']:.2f} "
          f"ideal_tandem_over_solo={first['ideal_tandem_over_solo']:.2f}")


if __name__ == "__main__":
    main()
