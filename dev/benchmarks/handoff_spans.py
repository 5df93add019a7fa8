"""Tokens a model writes before the other takes over, on real text: the span S that decoding only
the author pays one catch-up per (dev/author_only_decode.md).

    python dev/benchmarks/handoff_spans.py --rows 48 --tokens 400

DeepScaleR's reference solutions, tokenized by the real Qwen3 tokenizer, are fed through the
decoders' own handoff logic (``TandemDecoder``, both models' logits forcing the text's next token),
so the boundaries and the author draws are exactly a rollout's over that text; prints tokens per
author switch (``handoffs``) and per draw for each policy. A random-weight model writes other text
(the H100 CLI run's word handoff: 5.6 tokens a switch).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from tandem_lit.rollout.decoder import TandemDecoder
from tandem_lit.rollout.handoff import ParagraphHandoff, SentenceHandoff, TokenClasses, WordHandoff
from tandem_lit.rollout.sampling import SamplingConfig

SHARED = Path(__file__).resolve().parents[3] / "shared"
POLICIES = {"word": WordHandoff(p=0.5), "sentence": SentenceHandoff(p=0.5), "paragraph": ParagraphHandoff(p=0.5)}


def spans(tokenizer, texts: list[list[int]], policy) -> dict[str, float]:
    """Each text (token ids) written through ``policy``'s draws: tokens per switch and per draw."""
    classes = TokenClasses.from_tokenizer(tokenizer)
    rows, width = len(texts), max(map(len, texts))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=width, ignore_eos=True)
    decoder = TandemDecoder(policy, classes, sampling, rows, [tokenizer.eos_token_id or 0], tokenizer.pad_token_id or 0)
    lengths = torch.tensor([len(t) for t in texts])
    decoder.reset(torch.arange(rows) + 1, lengths)
    target = torch.zeros(rows, width, dtype=torch.long)
    for i, text in enumerate(texts):
        target[i, : len(text)] = torch.tensor(text)
    every = torch.arange(rows)
    while not decoder.all_finished():
        logits = torch.full((rows, classes.vocab_size), -1e4)
        logits[every, target[every, decoder.t.clamp(max=width - 1)]] = 0.0  # the text's next token, whoever writes
        decoder.step(logits, logits)
    out = decoder.outputs()
    tokens = int(lengths.sum())
    return {"tokens": tokens, "tokens_per_switch": tokens / max(int(out["handoffs"].sum()), 1),
            "tokens_per_draw": tokens / max(int(out["decisions"].sum()), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(SHARED / "models/qwen3-tokenizer"))
    parser.add_argument("--problems", default=str(SHARED / "data/deepscaler/train/deepscaler_subset_803.json"))
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=400, help="each solution's first tokens")
    parser.add_argument("--policies", nargs="+", default=["word"], choices=sorted(POLICIES))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    solutions = [row["solution"] for row in json.loads(Path(args.problems).read_text()) if row.get("solution")]
    random.Random(0).shuffle(solutions)
    texts = [ids[: args.tokens] for ids in (tokenizer(s, add_special_tokens=False).input_ids for s in solutions)
             if len(ids) >= 50][: args.rows]
    for name in args.policies:
        found = spans(tokenizer, texts, POLICIES[name])
        print(f"{name} handoff (p=0.5) over {found['tokens']:,} tokens of {len(texts)} solutions: "
              f"{found['tokens_per_switch']:.2f} tokens a switch, {found['tokens_per_draw']:.2f} a draw", flush=True)


if __name__ == "__main__":
    main()
