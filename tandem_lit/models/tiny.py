"""Tiny models and a character-level tokenizer, built with transformers classes.

Model weights cannot be downloaded everywhere (CI, offline laptops), so tests, the offline demo
and CPU benchmarks build small Llama-architecture models from configs. They are ordinary
``transformers`` models: they save, load and run through exactly the code paths hub models use.

    python -m tandem_lit.models.tiny configs/tiny/senior --hidden 64 --layers 2
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

# Printable ASCII: enough for GSM8K-style text, the demo's jargon and chat markers.
DEFAULT_ALPHABET = "".join(sorted(set(string.printable) - set("\x0b\x0c\r\t")))
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A fast tokenizer with one token per character (ids 0-3 are pad, bos, eos, unk)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab.setdefault(char, len(vocab))
    # BPE without merges splits text into characters and, unlike WordLevel, needs no pre-tokenizer.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def tiny_llama_config(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 2048,
    tie_embeddings: bool = True,
):
    """A LlamaConfig for a small model; token ids follow ``char_tokenizer``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )


def write_model_dir(path: str | Path, config, tokenizer, model=None) -> Path:
    """Save a config and tokenizer (and weights, if a model is given) as a hub-style folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if model is not None:
        model.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny Llama config and character tokenizer to a folder.")
    parser.add_argument("path")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args(argv)
    tokenizer = char_tokenizer()
    config = tiny_llama_config(len(tokenizer), args.hidden, args.layers, args.heads, args.kv_heads)
    print(write_model_dir(args.path, config, tokenizer))


if __name__ == "__main__":
    main()
