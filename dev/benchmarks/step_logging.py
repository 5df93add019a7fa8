"""What a training step's host-side records cost at the papers' size, beside its ~150 s: the
completions decoded for grading, the sampled completions file, and the MLflow metrics row
(issue 53: "MLflow logging and completion files for 128 x 3,000-token rollouts").

    python dev/benchmarks/step_logging.py [--tokenizer ../shared/models/qwen3-tokenizer]

128 rollouts of 3,000 token ids drawn from the real Qwen3 vocabulary, authors alternating in spans
of 6 tokens (the word handoff's mean on the H100, docs/partial_rollouts.md); the run's own writers:
``tandem_lit.training.completions.append`` and Lightning's ``MLFlowLogger`` on the sqlite store
``tandem-lit fit`` configures, with one step's metrics row (~80 metrics). Host-only: any machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from tandem_lit.rollout.record import Author, Rollout
from tandem_lit.rollout.result import RolloutResult
from tandem_lit.training import completions
from tandem_lit.verifiers.base import Grade

REPO = Path(__file__).resolve().parents[2]


def rollouts(tokenizer, rows: int, tokens: int, span: int, seed: int = 0) -> RolloutResult:
    gen = torch.Generator().manual_seed(seed)
    ordinary = len(tokenizer) - len(tokenizer.all_special_ids) - 300  # ids below the added tokens
    completion = torch.randint(0, ordinary, (rows, tokens), generator=gen)
    author = torch.where((torch.arange(tokens) // span) % 2 == 0, Author.SENIOR, Author.JUNIOR).to(torch.int8).repeat(rows, 1)
    prompt = torch.randint(0, ordinary, (rows, 150), generator=gen)
    rollout = Rollout(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion, author=author,
                      finished=torch.zeros(rows, dtype=torch.bool), truncated=torch.ones(rows, dtype=torch.bool),
                      handoffs=torch.full((rows,), tokens // span), decisions=torch.full((rows,), tokens // span),
                      junior_draws=torch.full((rows,), tokens // span // 2))
    grades = [Grade(reward=0.0, correct=False, extracted=None) for _ in range(rows)]
    return RolloutResult(rollout=rollout, grades=grades, group=torch.arange(rows) // 8, columns={})


def timed(label: str, fn, repeat: int = 1) -> None:
    fn()  # first call apart: imports, file creation
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    print(f"{label}: {(time.perf_counter() - start) / repeat * 1000:.1f} ms", flush=True)


def main() -> None:
    from lightning.pytorch.loggers import MLFlowLogger
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(REPO.parent / "shared/models/qwen3-tokenizer"))
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=3000)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    result = rollouts(tokenizer, args.rows, args.tokens, span=6)
    ids = result.rollout.completion_ids.tolist()
    timed(f"the completions decoded for grading ({args.rows} x {args.tokens} tokens)",
          lambda: tokenizer.batch_decode(ids, skip_special_tokens=True))
    metrics = {f"train/metric_{i}": float(i) for i in range(80)}
    with tempfile.TemporaryDirectory() as folder:
        for count in (4, args.rows):  # LoggingSettings.completions_per_log's default, and every rollout
            timed(f"completions.jsonl, {count} rollouts appended",
                  lambda count=count: completions.append(folder, result, tokenizer, "train", "run", 0, count), repeat=3)
        size = (Path(folder) / "completions.jsonl").stat().st_size
        print(f"completions.jsonl after those appends: {size / 1e6:.1f} MB")
        logger = MLFlowLogger(experiment_name="bench", tracking_uri=f"sqlite:///{folder}/mlflow.db")
        step = iter(range(10**6))
        timed("MLflow: one step's row of 80 metrics (sqlite store)", lambda: logger.log_metrics(metrics, step=next(step)), repeat=20)


if __name__ == "__main__":
    main()
