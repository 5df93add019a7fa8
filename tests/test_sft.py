"""tandem_lit.training.sft: prompt-masked supervised fine-tuning."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem_lit.models.tiny import char_tokenizer, tiny_llama_config
from tandem_lit.training.sft import IGNORE, SFTConfig, SFTExample, collate, encode_examples, run_sft, target_loss


def tiny_model(tokenizer, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden=32, layers=1, heads=2, kv_heads=1))


def test_labels_cover_exactly_the_target_and_end_token():
    tok = char_tokenizer()
    examples = [SFTExample("Question: 2+3?\nAnswer:", " 5"), SFTExample("Q: 1+1?\nA: 1+1 =", " 2 ok")]
    encoded = encode_examples(examples, tok)
    batch = collate(encoded, tok.pad_token_id)
    for row, example in enumerate(examples):
        context_len = len(example.context)  # one token per character
        labels = batch["labels"][row]
        target_ids = tok(example.target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        # the context, prefix of the answer included, is never a label
        assert (labels[:context_len] == IGNORE).all()
        assert labels[context_len : context_len + len(target_ids)].tolist() == target_ids
        # padding neither
        assert (labels[context_len + len(target_ids) :] == IGNORE).all()
        assert batch["attention_mask"][row].sum() == context_len + len(target_ids)
    assert batch["input_ids"][1, -1] == tok.pad_token_id  # the shorter row is right-padded


def test_loss_is_cross_entropy_over_target_tokens_only():
    tok = char_tokenizer()
    model = tiny_model(tok)
    example = SFTExample("Question: 4*2?\nAnswer: 4*2 =", " 8")
    batch = collate(encode_examples([example], tok), tok.pad_token_id)
    loss = target_loss(model, batch)
    logits = model(input_ids=batch["input_ids"]).logits[0]
    ids = batch["input_ids"][0]
    start = len(example.context)
    positions = range(start, len(ids))  # " ", "8", </s>
    manual = torch.stack([F.cross_entropy(logits[t - 1], ids[t]) for t in positions]).mean()
    torch.testing.assert_close(loss, manual)


def test_a_tiny_model_learns_its_targets():
    tok = char_tokenizer()
    model = tiny_model(tok, seed=1)
    examples = [SFTExample(f"Question: {a}+{b}?\nAnswer:", f" {a + b}") for a in range(5) for b in range(5)]
    losses = run_sft(model, tok, examples, SFTConfig(steps=60, batch_size=16, lr=1e-2, warmup_steps=5, seed=0))
    assert len(losses) == 60
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)
    assert not model.training  # handed back ready for generation


def test_run_sft_is_reproducible_from_the_seed():
    tok = char_tokenizer()
    examples = [SFTExample(f"Q{a}:", f" {a * 3}") for a in range(10)]
    config = SFTConfig(steps=5, batch_size=4, lr=5e-3, warmup_steps=1, seed=3)
    a, b = tiny_model(tok, seed=2), tiny_model(tok, seed=2)
    assert run_sft(a, tok, examples, config) == run_sft(b, tok, examples, config)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
