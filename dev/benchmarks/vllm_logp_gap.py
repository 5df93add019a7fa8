"""Where VLLMEngine's rollout-vs-train log-prob gap comes from (issue 25), on random weights.

The GRPO config with VLLMEngine measured a gap of 1.23 nats (mean) where FastEngine's was 0.061 on
the same step; every event here stayed at FastEngine's 0.053, because the cause was the build: the
training step built vLLM under Lightning's autocast, which put its rotary table in bf16 (fixed:
dev/log.md; ``train_step.py --dump-logprobs`` and ``gap_report.py`` found it). This scores one vLLM engine's rollouts against the training forward (float32 master
under bf16 autocast, as the update runs it) after each of a series of engine events, in one
process, so the event that opens the gap shows itself:

    fresh     the first generate after the weights were loaded
    again     a second generate, nothing in between (a control)
    reload    load_weights with the same weights, no sleep
    sleep1    release() at sleep level 1 (weights to host), then generate (wakes them)
    sleep2    release() at sleep level 2 (weights dropped), then generate (wake + reload)
    autocast  generate under bf16 autocast, as training_step runs under Lightning's bf16-mixed
    autocast-unguarded   the same with VLLMEngine's ``outside_autocast`` taken out (what it fixes)

Every event decodes the same prompts with the same seeds, so the same weights give the same tokens:
each row also says what share of tokens equal the first event's. FastEngine's rollouts of them are
scored first, as the reference. Every row prints the mean and max |rollout - train| over
completion tokens, the mean by quarter of the completion, and the share of tokens more than 1 nat
off. ``--lengths lognormal`` gives rows their own budgets (rows finish at different steps, as in
training); ``--copies n`` decodes each prompt n times (vLLM's prefix cache shares it). ``--rescore`` then scores the last event's rollouts by
vLLM's own prefill (teacher-forced, ``prompt_logprobs``) against the training forward, both at
temperature 1: agreement there and not in the decoded log-probs points at vLLM's decode path.

    python dev/benchmarks/vllm_logp_gap.py --shape qwen3-4b --rows 32 --tokens 1000 \
        --vllm-kwargs '{"kv_cache_gib": 24, "max_model_len": 4096}' --events fresh again sleep2 sleep1
    python dev/benchmarks/vllm_logp_gap.py ... --vllm-kwargs '{"kv_cache_gib": 24, "enforce_eager": true}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from benchmarks.rollout import draw_budgets, parse_lengths  # noqa: E402
from dev.benchmarks.logp_gap import (  # noqa: E402
    SHAPES,
    NullTokenizer,
    build,
    engine_rollout,
    forward_logprobs,
    mean_by_quarter,
    prompts,
)
from tandem_lit.rollout.handoff import SoloHandoff  # noqa: E402
from tandem_lit.rollout.record import PromptBatch, Rollout  # noqa: E402
from tandem_lit.rollout.sampling import SamplingConfig  # noqa: E402
from tandem_lit.rollout.weights import rollout_named_tensors  # noqa: E402

EVENTS = ("fresh", "again", "reload", "sleep1", "sleep2", "autocast", "autocast-unguarded")


def gap_summary(rollout: Rollout, train: Tensor) -> dict:
    mask = rollout.completion_mask
    gap = (rollout.senior_logprobs.float() - train).abs()
    by_row = [float(gap[r][mask[r]].mean()) for r in range(mask.shape[0])]
    return {
        "mean": float(gap[mask].mean()),
        "max": float(gap[mask].max()),
        "over_1_nat": float((gap[mask] > 1).float().mean()),
        "by_quarter": mean_by_quarter(gap, mask),
        "worst_rows": sorted(range(len(by_row)), key=lambda r: -by_row[r])[:4],
        "row_means": [round(g, 4) for g in by_row],
    }


def vllm_teacher_forced(engine, rollout: Rollout) -> Tensor:  # -> [N, T]
    """Each completion token's log-prob (temperature 1) from vLLM's prefill of prompt + completion
    (``prompt_logprobs=0``: the given token's own), one request per row."""
    written = rollout.completion_mask
    rows = [ids[mask.bool()].tolist() + done[keep].tolist() for ids, mask, done, keep in
            zip(rollout.prompt_ids.cpu(), rollout.prompt_mask.cpu(), rollout.completion_ids.cpu(), written.cpu())]
    params = engine.vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outputs = engine.llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
    scores = torch.zeros(written.shape, dtype=torch.float32)
    for r, (row, out) in enumerate(zip(rows, outputs)):
        start = len(row) - int(written[r].sum())
        scores[r, : len(row) - start] = torch.tensor([out.prompt_logprobs[i][row[i]].logprob for i in range(start, len(row))])
    return scores.to(written.device)


def report(name: str, summary: dict) -> None:
    print(f"{name:<12} same tokens {summary.get('same_tokens_as_first', float('nan')):.3f}  gap mean {summary['mean']:.4f} max {summary['max']:.3f} >1 nat {summary['over_1_nat']:.3%}  "
          f"by quarter {' '.join(f'{g:.4f}' for g in summary['by_quarter'])}  "
          f"worst rows {summary['worst_rows']} ({', '.join(str(summary['row_means'][r]) for r in summary['worst_rows'])})",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1000, help="completion tokens per rollout")
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(64, 512), metavar=("SHORTEST", "LONGEST"))
    parser.add_argument("--temperature", type=float, default=0.6, help="the configs' sampling temperature")
    parser.add_argument("--lengths", default="fixed", help="fixed (every row --tokens) or lognormal[:median=..,sigma=..,cap=..]")
    parser.add_argument("--copies", type=int, default=1, help="rollouts per prompt (vLLM caches a shared prompt)")
    parser.add_argument("--micro", type=int, default=4, help="rows per teacher-forced forward")
    parser.add_argument("--vllm-kwargs", default='{"kv_cache_gib": 24, "max_model_len": 4096}',
                        help="VLLMEngine arguments, JSON")
    parser.add_argument("--events", nargs="+", default=["fresh", "again", "sleep2", "sleep1"], choices=EVENTS)
    parser.add_argument("--rescore", action="store_true",
                        help="also teacher-force the last event's rollouts inside vLLM (its prefill) at temperature 1")
    parser.add_argument("--no-fast-engine", action="store_true", help="skip FastEngine's reference row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from tandem_lit.rollout import vllm_engine
    from tandem_lit.rollout.vllm_engine import VLLMEngine

    started = time.perf_counter()
    model = build(args.shape, {}, "cuda", args.seed)
    batch = prompts(args.rows // args.copies, model.config.vocab_size, *args.prompt_lengths, args.seed, "cuda")
    if args.copies > 1:  # n rollouts of each prompt, one seed each, as training draws them
        batch = PromptBatch(batch.input_ids.repeat_interleave(args.copies, 0),
                            batch.attention_mask.repeat_interleave(args.copies, 0), torch.arange(args.rows, device="cuda"))
    lengths = parse_lengths(args.lengths, tiny=False)
    if lengths is not None:  # per-row budgets: rows finish at different steps, as in training
        batch.max_new_tokens = draw_budgets(lengths, args.rows, args.seed).to("cuda")
        args.tokens = int(batch.max_new_tokens.max())
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.tokens, ignore_eos=True, seed=args.seed)
    t = args.temperature
    print(f"# {args.shape}: {args.rows} rollouts x {args.tokens} tokens, prompts {args.prompt_lengths[0]}-"
          f"{args.prompt_lengths[1]}, temperature {t}; vLLM {args.vllm_kwargs}", flush=True)
    results = {}
    if not args.no_fast_engine:
        rollout, _ = engine_rollout(model, batch, sampling, "auto")
        results["FastEngine"] = gap_summary(rollout, forward_logprobs(model, rollout, t, True, args.micro))
        report("FastEngine", results["FastEngine"])
        del rollout
        torch.cuda.empty_cache()

    engine = VLLMEngine(**json.loads(args.vllm_kwargs))
    tick = time.perf_counter()
    engine.setup(model, None, NullTokenizer(model.config.vocab_size))
    print(f"vLLM built and loaded in {time.perf_counter() - tick:.0f} s", flush=True)
    first = None
    for step, event in enumerate(args.events):
        if event == "reload":
            engine.load_weights(rollout_named_tensors(model))
        elif event.startswith("sleep"):
            engine.sleep_level = int(event[-1])
            engine.release()
        tick = time.perf_counter()
        guard = vllm_engine.outside_autocast
        if event == "autocast-unguarded":
            vllm_engine.outside_autocast = contextlib.nullcontext
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=event.startswith("autocast")):
                rollout = engine.generate(batch, SoloHandoff("senior"), sampling)
        finally:
            vllm_engine.outside_autocast = guard
        decoded = time.perf_counter() - tick
        name = f"vLLM {event}"
        results[name] = gap_summary(rollout, forward_logprobs(model, rollout, t, True, args.micro))
        results[name]["generate_s"] = decoded
        # the same seeds every event: the same weights must give the same tokens as the first
        first = first if step else rollout.completion_ids
        results[name]["same_tokens_as_first"] = float((rollout.completion_ids == first).float().mean())
        report(name, results[name])
    if args.rescore:
        # the last event's rollouts teacher-forced inside vLLM (its prefill path, not the decode
        # graphs), at temperature 1, against the training forward at temperature 1: if these agree
        # while the decoded log-probs do not, vLLM's decode path is what differs
        rescored = Rollout(**{**vars(rollout), "senior_logprobs": vllm_teacher_forced(engine, rollout)})
        results["vLLM prefill rescoring (temperature 1)"] = summary = gap_summary(
            rescored, forward_logprobs(model, rescored, 1.0, True, args.micro))
        report("vLLM rescore", summary)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
