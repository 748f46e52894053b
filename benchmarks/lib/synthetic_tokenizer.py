"""A synthetic byte-level BPE tokenizer of a given size, built offline and deterministically.

    python benchmarks/lib/synthetic_tokenizer.py OUT_DIR [--vocab-size 151936]

Dummy-weight presets (`dummy:qwen3-0.6b`) carry no tokenizer, and a grammar mask needs one: its
cost per step grows with the vocabulary the matcher walks. `write_synthetic_tokenizer` writes a
`tokenizer.json` + `tokenizer_config.json` that `transformers.AutoTokenizer` loads (pass the folder
as `LLM(..., tokenizer=OUT_DIR)`), shaped like a GPT-2/Qwen vocabulary:

  * the 256 byte tokens, spelled in GPT-2's byte-to-unicode alphabet ("Ġ" is a space), with the
    ByteLevel pre-tokenizer and decoder, so xgrammar's `TokenizerInfo.from_huggingface` reads it
    as a byte-level vocabulary and every text round-trips through encode/decode;
  * multi-byte tokens learned by tokenizers' BPE trainer from a corpus drawn with a seeded
    `random.Random`: words (lowercase letters in English frequencies, often with a leading space
    or a capital), runs of punctuation and whitespace (`", `, `":`, `{"`, newlines), numbers, CJK
    characters (3 UTF-8 bytes each) and accented, Greek and Cyrillic letters (2 bytes), so the
    merges are a real BPE ranking (" the" encodes as the one token "Ġthe");
  * special tokens at fixed ids, Qwen3's by default (`<|endoftext|>` 151643, `<|im_start|>` 151644,
    `<|im_end|>` 151645 = EOS, as in `dummy:qwen3-0.6b`'s config).

The same arguments give the same files (under one `tokenizers` version: its trainer breaks ties
its own way). Exactly `vocab_size` ids, 0 .. vocab_size - 1, each one token. Qwen3's size takes
~10 s on one core, most of it the trainer.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Mapping, Optional

QWEN3_SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
QWEN3_EOS = "<|im_end|>"
# English letter frequencies (per mille), for words that look like words
LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
LETTER_WEIGHTS = [127, 91, 82, 75, 70, 67, 63, 61, 60, 43, 40, 28, 28, 24, 24, 22, 20, 20, 20,
                  15, 10, 8, 2, 2, 1, 1]
PUNCT = "\"',.:;!?()[]{}<>-_=+*/\\|#@$%&^~` \n\t"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what ByteLevel pre-tokenizers use):
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _draw_word(rng: random.Random) -> str:
    """One word of the corpus."""
    kind = rng.random()
    if kind < 0.72:  # a word: " the", "Hello", "ing"
        n = min(1 + int(rng.expovariate(1 / 3)), 12)
        word = "".join(rng.choices(LETTERS, LETTER_WEIGHTS, k=n))
        if rng.random() < 0.25:
            word = word.capitalize()
        return (" " if rng.random() < 0.55 else "") + word
    if kind < 0.84:  # punctuation and whitespace: '", ', '":', '{"', "\n\n", "    "
        return "".join(rng.choices(PUNCT, k=rng.randint(2, 4)))
    if kind < 0.88:  # digits (with an optional leading space)
        return (" " if rng.random() < 0.3 else "") + str(rng.randrange(10, 1000))
    if kind < 0.96:  # one to three CJK characters: 3 UTF-8 bytes each
        return "".join(chr(rng.randrange(0x4E00, 0xA000)) for _ in range(rng.randint(1, 3)))
    # accented Latin, Greek and Cyrillic letters: 2 UTF-8 bytes each
    return "".join(chr(rng.randrange(0xC0, 0x500)) for _ in range(rng.randint(1, 4)))


def synthetic_corpus(num_words: int, seed: int = 0) -> list[str]:
    """`num_words` words drawn from a seeded `random.Random` (the same on every Python)."""
    rng = random.Random(seed)
    return [_draw_word(rng) for _ in range(num_words)]


def train_byte_level_bpe(vocab_size: int, special_ids: Mapping[str, int], seed: int = 0
                         ) -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens by id, merges by rank) in the byte alphabet: tokenizers' BPE trainer run on
    `synthetic_corpus` until the vocabulary has `vocab_size` ids. Ids 0..255 are the bytes in
    order (as in GPT-2 and Qwen), then the merged tokens in the order they were learned; the ids
    in `special_ids` hold those tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(special_ids):
        raise ValueError(f"vocab_size must be at least 256 + {len(special_ids)} special tokens, "
                         f"got {vocab_size}")
    for token, i in special_ids.items():
        if not 0 <= i < vocab_size:
            raise ValueError(f"special token {token!r} has id {i}, outside [0, {vocab_size})")
    n_regular = vocab_size - len(special_ids)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=n_regular, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    num_words = 2 * vocab_size  # enough distinct pieces to learn vocab_size - 256 merges
    bpe.train_from_iterator(synthetic_corpus(num_words, seed), trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) for m in model["merges"]]
    byte_char = bytes_to_unicode()
    # two merges may spell one token ("ab"+"c", "a"+"bc"): it keeps its first id
    regular = list(dict.fromkeys([byte_char[b] for b in range(256)] + [a + b for a, b in merges]))
    if len(regular) != n_regular or set(regular) != set(model["vocab"]):
        raise ValueError(f"a corpus of {num_words} words gave {len(regular)} tokens, "
                         f"not {n_regular}")
    by_id = {i: token for token, i in special_ids.items()}
    rest = iter(regular)
    return [by_id[i] if i in by_id else next(rest) for i in range(vocab_size)], merges


def write_synthetic_tokenizer(out_dir, vocab_size: int = 151936, seed: int = 0,
                              special_tokens: Optional[Mapping[str, int]] = None,
                              eos_token: Optional[str] = None) -> Path:
    """Write tokenizer.json + tokenizer_config.json into `out_dir`; returns the folder.
    Defaults: Qwen3's size, special tokens and EOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if special_tokens is None:
        special_tokens = QWEN3_SPECIAL_TOKENS
        eos_token = QWEN3_EOS if eos_token is None else eos_token
    if eos_token is not None and eos_token not in special_tokens:
        raise ValueError(f"eos_token {eos_token!r} is not one of the special tokens "
                         f"{sorted(special_tokens)}")
    tokens, merges = train_byte_level_bpe(vocab_size, special_tokens, seed)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in sorted(special_tokens, key=special_tokens.get)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
              "pad_token": eos_token, "bos_token": None, "add_bos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print("wrote", write_synthetic_tokenizer(a.out_dir, a.vocab_size, a.seed))


if __name__ == "__main__":
    main()
