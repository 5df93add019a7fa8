"""Take a rollout-vs-train log-prob gap apart, offline, from ``train_step.py --dump-logprobs``.

A mean gap says that the engine and the training forward disagree, not where. From the dumped
update passes (each row's prompt, completion, authors, the engine's log-probs and the training
forward's) this prints the gap of the senior's tokens by position in the completion and by
absolute position (prompt + completion), by row, the share of tokens more than 1 nat off and the
signed difference (one-sided when a side renormalises, as top-k would); and
two alignment checks: the engine's log-prob of token t against the training forward's of t-1 and
t+1 (an off-by-one shows as a smaller gap there). A gap that grows with the absolute position gets
a hint line: that is how a bf16 rotary table (vLLM built under autocast, issue 25) showed itself.

    python benchmarks/train_step.py ... --dump-logprobs /tmp/gap      # writes /tmp/gap.<arm>.pt
    python benchmarks/gap_report.py /tmp/gap.grpo-vllm.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem_lit.rollout.record import Author  # noqa: E402

EDGES = (0, 128, 512, 1024, 1536, 2048, 2560, 3072, 4096, 1 << 30)


def rows_of(dump: dict) -> list[dict]:
    """One entry per scored row: its senior tokens' positions and both sides' log-probs."""
    rows = []
    for number, p in enumerate(dump["passes"]):
        if p["engine_logprobs"] is None:
            continue
        prompt_lengths = p["prompt_mask"].sum(-1)
        for r in range(p["completion_ids"].shape[0]):
            senior = p["author"][r] == Author.SENIOR
            if not senior.any():
                continue
            rows.append({"engine": p["engine_logprobs"][r], "train": p["train_logprobs"][r], "senior": senior,
                         "prompt": int(prompt_lengths[r]), "length": int((p["author"][r] != Author.PAD).sum()),
                         "pass": number})
    return rows


def bucketed(gaps: torch.Tensor, positions: torch.Tensor, title: str) -> None:
    cells = []
    for low, high in zip(EDGES[:-1], EDGES[1:]):
        inside = (positions >= low) & (positions < high)
        if inside.any():
            label = f"{low}+" if high == EDGES[-1] else f"{low}-{high}"
            cells.append(f"{label}: {float(gaps[inside].mean()):.3f} ({int(inside.sum())})")
    print(f"{title}: " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump")
    args = parser.parse_args()
    rows = rows_of(torch.load(args.dump, weights_only=False))
    if not rows:
        raise SystemExit(f"{args.dump}: no senior-written token with the engine's log-probs in any pass")
    gaps, signed, completion_pos, absolute_pos, shifted = [], [], [], [], {-1: [], 1: []}
    for row in rows:
        index = torch.nonzero(row["senior"]).squeeze(-1)
        signed.append(row["engine"][index] - row["train"][index])
        gap = signed[-1].abs()
        gaps.append(gap)
        completion_pos.append(index)
        absolute_pos.append(index + row["prompt"])
        for shift in shifted:
            ok = (index + shift >= 0) & (index + shift < row["length"])
            shifted[shift].append((row["engine"][index[ok]] - row["train"][index[ok] + shift]).abs())
    gap, completion_at, absolute_at = torch.cat(gaps), torch.cat(completion_pos), torch.cat(absolute_pos)
    print(f"{args.dump}: {len(rows)} rows, {gap.numel()} senior tokens; gap mean {float(gap.mean()):.4f} "
          f"max {float(gap.max()):.3f}; {float((gap > 1).float().mean()):.2%} of tokens more than 1 nat off")
    difference = torch.cat(signed)  # engine - train: one-sided when a side renormalises (top-k/top-p) or rescales
    print(f"engine - train: mean {float(difference.mean()):+.4f}, positive for {float((difference > 0).float().mean()):.1%} "
          "of tokens")
    passes = torch.cat([torch.full_like(g, row["pass"], dtype=torch.long) for g, row in zip(gaps, rows)])
    print("by update pass (warm-up steps first; a gap that appears only after an update points at the weight "
          "push): " + "  ".join(f"#{n}: {float(gap[passes == n].mean()):.3f} ({int((passes == n).sum())})"
                                for n in sorted(set(passes.tolist()))))
    bucketed(gap, completion_at, "by position in the completion")
    bucketed(gap, absolute_at, "by absolute position (prompt + completion)")
    per_row = sorted(((float(g.mean()), i, row["prompt"], row["length"]) for i, (g, row) in enumerate(zip(gaps, rows))),
                     reverse=True)
    print("worst rows (mean gap, row, prompt tokens, completion tokens): "
          + "  ".join(f"{m:.3f} #{i} {p}+{n}" for m, i, p, n in per_row[:6]))
    print("best rows: " + "  ".join(f"{m:.3f} #{i} {p}+{n}" for m, i, p, n in per_row[-3:]))
    for shift, parts in shifted.items():
        print(f"engine[t] vs train[t{shift:+d}]: mean {float(torch.cat(parts).mean()):.4f}")
    first = torch.stack([g[0] for g in gaps])
    print(f"first completion token: mean {float(first.mean()):.4f} max {float(first.max()):.3f}")
    early, late = gap[absolute_at < 256], gap[absolute_at >= 1024]
    if early.numel() and late.numel() and float(late.mean()) > 3 * float(early.mean()) + 0.02:
        print(f"hint: the gap grows with the absolute position ({float(early.mean()):.3f} below 256, "
              f"{float(late.mean()):.3f} from 1,024): the two sides place tokens differently. Look at the "
              "rotary tables (one computed in bf16, as vLLM's was when built under autocast) and the position ids.")


if __name__ == "__main__":
    main()
