"""Where the rollout-vs-train log-prob gap comes from (issue 26), on random weights.

One batch of rollouts (left-padded random prompts of different lengths, completions sampled by
FastEngine from the senior's bf16 rollout copy, as in training) is scored token by token by:

    engine      FastEngine's own log-probs of what it sampled (bf16 copy; Triton kernels on CUDA)
    engine-tf   the same decode step teacher-forced over the same tokens (a check of the scorer,
                and the base of the engine variants below)
    train       the training forward as the update runs it: float32 master weights under bf16
                autocast (Lightning's bf16-mixed), transformers' torch path of the chunked delta rule
    fp32        the same forward in float32 (the reference both sides approximate)
    hf-bf16     the bf16 copy's own Hugging Face forward (the chunked rule over bf16 weights)

and the training forward without each of issue 26's changes (``train[embeddings fp32]``: the float32
master embeddings the update used to read where the engine reads bf16 ones; ``train[delta rule
autocast]``: the chunked rule's matmuls rounding to bf16 where the engine's recurrence runs in
float32; ``train[both]``), so each change's share of the gap is the distance it removes. Every row
prints mean and max |a - b| over completion tokens against ``engine``, ``train`` and ``fp32`` (the
update's metric ``train/rollout_logp_gap_*`` is |train - engine| over the senior's tokens);
``--per-layer`` adds each layer's relative hidden-state error against fp32 (train and hf-bf16).

    python dev/benchmarks/logp_gap.py --shape tiny-qwen35                   # CPU, seconds
    python dev/benchmarks/logp_gap.py --shape qwen35-9b --device cuda --rows 16 --tokens 3000
    python dev/benchmarks/logp_gap.py --shape qwen3-4b --device cuda --rows 16 --tokens 3000   # the baseline
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tandem_lit.rollout import logprobs  # noqa: E402
from tandem_lit.rollout.handoff import SoloHandoff  # noqa: E402
from tandem_lit.rollout.logprobs import completion_logprobs  # noqa: E402
from tandem_lit.rollout.record import PromptBatch, Rollout  # noqa: E402
from tandem_lit.rollout.sampling import SamplingConfig  # noqa: E402
from tandem_lit.rollout.static import FastEngine  # noqa: E402
from tandem_lit.rollout.static.engine import decoder_model  # noqa: E402

# config.json values of the architectures the configs train (benchmarks/train_step.py's SHAPES,
# whose Qwen3.5-2B values are ASSUMED), and small ones for the CPU
QWEN3 = dict(model_type="qwen3", vocab_size=151936, hidden_act="silu", rms_norm_eps=1e-6, head_dim=128,
             tie_word_embeddings=True, attention_bias=False)
SHAPES = {
    "qwen35-9b": dict(model_type="qwen3_5_text"),  # transformers' Qwen3_5TextConfig defaults are the 9B
    "qwen35-2b": dict(model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3-4b": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=5_000_000.0),
    # the 9B's head sizes and layer pattern at a quarter of the width: runs on a CPU in minutes
    "small-qwen35": dict(model_type="qwen3_5_text", vocab_size=8192, hidden_size=1024, intermediate_size=1024,
                         linear_num_key_heads=8, linear_num_value_heads=16, num_attention_heads=8, num_key_value_heads=2),
    "small-qwen3": dict(QWEN3, vocab_size=8192, hidden_size=1024, intermediate_size=1024, num_hidden_layers=32,
                        num_attention_heads=8, num_key_value_heads=2),
    "tiny-qwen35": dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32),
}


def mean_by_quarter(gap: Tensor, written: Tensor) -> list[float]:
    """The mean of ``gap`` [N, T] over the written tokens of each quarter of the completion's width."""
    quarters = torch.arange(gap.shape[1], device=gap.device) * 4 // gap.shape[1]
    return [float(gap[written & (quarters == q)].mean()) for q in range(4)]


class NullTokenizer:
    """What an engine needs of a tokenizer when nothing is read as text (random weights)."""

    eos_token_id, pad_token_id, all_special_ids = 2, 0, [0, 1, 2]

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def encode(self, text, add_special_tokens=False) -> list[int]:
        return []

    def batch_decode(self, rows, skip_special_tokens=True) -> list[str]:
        return [""] * len(rows)


def build(shape: str, overrides: dict, device: str, seed: int) -> nn.Module:
    """A float32 model of ``shape`` with random weights (transformers' init, as ``random_init``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(SHAPES[shape], **{k: v for k, v in overrides.items() if v is not None}, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prompts(rows: int, vocab: int, shortest: int, longest: int, seed: int, device: str) -> PromptBatch:
    """Left-padded random prompts of lengths spread over [shortest, longest]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (rows,), generator=g)
    lengths[0] = longest
    ids = torch.randint(3, vocab, (rows, longest), generator=g)
    mask = (torch.arange(longest)[None, :] >= longest - lengths[:, None]).long()
    return PromptBatch((ids * mask).to(device), mask.to(device), torch.arange(rows, device=device))


@torch.no_grad()
def engine_rollout(model: nn.Module, batch: PromptBatch, sampling: SamplingConfig, kernels: str) -> tuple[Rollout, nn.Module]:
    """FastEngine's rollouts of the float32 ``model`` as training runs it: decoded from the
    engine's own bf16 rollout copy (fused projections sharing its storage), which is returned."""
    engine = FastEngine(kernels=kernels, rollout_dtype="bfloat16")
    engine.setup(model, None, NullTokenizer(model.config.vocab_size))
    rollout = engine.generate(batch, SoloHandoff("senior"), sampling)
    engine.release()
    return rollout, engine.senior


@torch.no_grad()
def teacher_forced_engine(decoder, rollout: Rollout, temperature: float, triton: bool) -> Tensor:  # -> [N, T]
    """The engine's decode step (``decoder_model``) fed the rollout's own tokens: prefill, then one
    step per completion token, each row at its own position and cache slot as FastEngine keeps them."""
    ids, mask, completion = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
    rows, width = ids.shape
    length = width + completion.shape[1]
    decoder.allocate(rows, length)
    no_autocast = torch.autocast(ids.device.type, enabled=False)
    with no_autocast:
        logits = decoder.prefill(ids, mask, torch.arange(rows, device=ids.device)).float()
        slot = torch.full((rows,), width - 1, device=ids.device)
        position = mask.sum(-1) - 1
        valid = torch.zeros(rows, length, dtype=torch.bool, device=ids.device)
        valid[:, :width] = mask.bool()
        out = []
        for t in range(completion.shape[1]):
            token = completion[:, t]
            out.append((logits / temperature).log_softmax(-1).gather(-1, token[:, None])[:, 0])
            if t + 1 == completion.shape[1]:
                break
            slot += 1
            position += 1
            valid.scatter_(1, slot[:, None], True)
            logits = decoder.decode(token, position, slot, valid, length, triton).float()
    decoder.free()
    return torch.stack(out, 1)


def forward_logprobs(model: nn.Module, rollout: Rollout, temperature: float, autocast: bool, micro: int) -> Tensor:
    """Teacher-forced log-probs (``rollout.logprobs``, as the update computes them), ``micro`` rows
    at a time, under bf16 autocast or not."""
    parts = []
    with torch.no_grad(), torch.autocast(rollout.prompt_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        for start in range(0, rollout.completion_ids.shape[0], micro):
            part = rollout.select(torch.arange(start, min(start + micro, rollout.completion_ids.shape[0])))
            parts.append(completion_logprobs(model, part, temperature).float())
    return torch.cat(parts)


@contextlib.contextmanager
def delta_rule_under_autocast() -> Iterator[None]:
    """transformers' chunked gated delta rule as it comes, its matmuls rounding to bf16 under
    autocast (before issue 26's ``logprobs.float32_delta_rule``)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35

    logprobs.float32_delta_rule()
    patched, install = qwen35.torch_chunk_gated_delta_rule, logprobs.float32_delta_rule
    qwen35.torch_chunk_gated_delta_rule = patched.__wrapped__
    logprobs.float32_delta_rule = lambda: None
    try:
        yield
    finally:
        qwen35.torch_chunk_gated_delta_rule, logprobs.float32_delta_rule = patched, install


@contextlib.contextmanager
def embeddings_in_float32() -> Iterator[None]:
    """The training forward reading the float32 master embeddings (before issue 26's
    ``logprobs.embeddings_at_compute_precision``)."""
    rounded = logprobs.embeddings_at_compute_precision
    logprobs.embeddings_at_compute_precision = lambda model: contextlib.nullcontext()
    try:
        yield
    finally:
        logprobs.embeddings_at_compute_precision = rounded


def hidden_states(model: nn.Module, inputs: dict, autocast: bool) -> tuple[Tensor, ...]:
    """Every layer's output, under bf16 autocast as the training forward runs it (or not)."""
    device = inputs["input_ids"].device.type
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), logprobs.engine_matched_precision(model):
        return model.model(**inputs, output_hidden_states=True, use_cache=False).hidden_states


def per_layer_errors(model: nn.Module, copy_: nn.Module, rollout: Rollout, micro: int) -> dict[str, list[float]]:
    """Relative hidden-state error of each layer's output against float32: the training forward
    (autocast) and the bf16 copy's forward."""
    sums: dict[str, list[float]] = {}
    norms: list[float] = []
    for start in range(0, rollout.completion_ids.shape[0], micro):
        part = rollout.select(torch.arange(start, min(start + micro, rollout.completion_ids.shape[0])))
        ids = torch.cat([part.prompt_ids, part.completion_ids], 1)
        mask = torch.cat([part.prompt_mask, part.completion_mask.long()], 1)
        inputs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
        real = mask.bool()
        reference = hidden_states(model, inputs, False)
        norms = [a + float(r[real].float().pow(2).sum()) for a, r in zip(norms or [0.0] * len(reference), reference)]
        for name, m, autocast in (("train", model, True), ("hf-bf16", copy_, False)):
            states = hidden_states(m, inputs, autocast)
            errors = [float((h[real].float() - r[real]).pow(2).sum()) for h, r in zip(states, reference)]
            sums[name] = [a + e for a, e in zip(sums.get(name, [0.0] * len(errors)), errors)]
    return {name: [(e / n) ** 0.5 for e, n in zip(errs, norms)] for name, errs in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny-qwen35", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--hidden", type=int, default=None, help="override hidden_size")
    parser.add_argument("--vocab", type=int, default=None, help="override vocab_size")
    parser.add_argument("--rows", type=int, default=4, help="rollouts")
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens per rollout")
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(8, 64), metavar=("SHORTEST", "LONGEST"))
    parser.add_argument("--temperature", type=float, default=0.6, help="the configs' sampling temperature")
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"], help="FastEngine's decode path")
    parser.add_argument("--micro", type=int, default=2, help="rows per teacher-forced forward")
    parser.add_argument("--variants", nargs="*", default=None, help="which variants to score (default: all)")
    parser.add_argument("--per-layer", action="store_true", help="each layer's relative hidden-state error")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    model = build(args.shape, {"num_hidden_layers": args.layers, "hidden_size": args.hidden, "vocab_size": args.vocab},
                  args.device, args.seed)
    config = model.config
    hybrid = "linear_attention" in (getattr(config, "layer_types", None) or [])
    batch = prompts(args.rows, config.vocab_size, *args.prompt_lengths, args.seed, args.device)
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.tokens, ignore_eos=True, seed=args.seed)
    rollout, copy_ = engine_rollout(model, batch, sampling, args.kernels)
    triton = args.device == "cuda" and args.kernels != "torch"
    t = args.temperature
    print(f"# {args.shape} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}) "
          f"on {args.device}: {args.rows} rollouts x {args.tokens} tokens, prompts {args.prompt_lengths[0]}-"
          f"{args.prompt_lengths[1]} tokens, temperature {t}, engine kernels {'triton' if triton else 'torch'}", flush=True)

    scores: dict[str, Tensor] = {"engine": rollout.senior_logprobs.float()}
    variants: dict[str, Callable[[], Tensor]] = {
        "engine-tf": lambda: teacher_forced_engine(decoder_model(copy_), rollout, t, triton),
        "train": lambda: forward_logprobs(model, rollout, t, True, args.micro),
        "fp32": lambda: forward_logprobs(model, rollout, t, False, args.micro),
        "hf-bf16": lambda: forward_logprobs(copy_, rollout, t, False, args.micro),
        # the training forward without each of issue 26's changes (a variant's distance to the
        # engine against train's is what that change buys)
        "train[embeddings fp32]": lambda: scored_with(embeddings_in_float32(), model, rollout, t, args.micro),
    }
    if hybrid:
        variants["train[delta rule autocast]"] = lambda: scored_with(delta_rule_under_autocast(), model, rollout, t, args.micro)
        variants["train[both]"] = lambda: scored_with(
            both(embeddings_in_float32(), delta_rule_under_autocast()), model, rollout, t, args.micro)
    for name, score in variants.items():
        if args.variants is None or name in args.variants or name in ("train", "fp32"):
            tick = time.perf_counter()
            scores[name] = score()
            print(f"  scored {name} in {time.perf_counter() - tick:.1f} s", flush=True)

    mask = rollout.completion_mask
    columns = ("engine", "train", "fp32")
    print(f"{'|a - b| of log-probs':<40}" + "".join(f"{'vs ' + c + ': mean':>17}{'max':>7}" for c in columns))
    table = {}
    for name, logp in scores.items():
        row = {}
        for against in columns:
            gap = (logp - scores[against]).abs()[mask]
            row[against] = (float(gap.mean()), float(gap.max()))
        table[name] = row
        print(f"{name:<40}" + "".join(f"{row[c][0]:>17.4f}{row[c][1]:>7.3f}" for c in columns))
    by_quarter = mean_by_quarter((scores["engine"] - scores["train"]).abs(), mask)
    print("engine vs train by quarter of the completion: " + " ".join(f"{g:.4f}" for g in by_quarter))
    layers = per_layer_errors(model, copy_, rollout, args.micro) if args.per_layer else None
    if layers:
        for name, errors in layers.items():
            print(f"{name} relative hidden error per layer: " + " ".join(f"{e:.4f}" for e in errors))
    print(f"engine_train_gap_mean={table['engine']['train'][0]:.4f} max={table['engine']['train'][1]:.3f} "
          f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "gaps": table, "by_quarter": by_quarter,
                                               "per_layer": layers}, indent=2))


@contextlib.contextmanager
def both(first, second) -> Iterator[None]:
    with first, second:
        yield


def scored_with(context, model: nn.Module, rollout: Rollout, temperature: float, micro: int) -> Tensor:
    with context:
        return forward_logprobs(model, rollout, temperature, True, micro)


if __name__ == "__main__":
    main()
