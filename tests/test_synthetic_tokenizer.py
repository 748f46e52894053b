"""benchmarks/lib/synthetic_tokenizer.py: the byte-level tokenizer the structured-outputs benchmark
gives `dummy:qwen3-0.6b` (no tokenizer of its own). It must have exactly the model's 151,936 ids,
Qwen3's special tokens where the preset's config puts them, round-trip any text, be the same on
every build, and be read by xgrammar as a byte-level vocabulary that a JSON schema compiles for."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH / "lib"))
import synthetic_tokenizer as st  # noqa: E402
from structured_outputs import SCHEMA  # noqa: E402

QWEN3_VOCAB = 151936
TEXTS = ['{"name": "Lily", "age": 7, "pets": ["cat", "dog"]}',
         "Once upon a time,\n\tthere was a little girl named Lily.  She was 3 years old!",
         "你好，世界 ünïcödé 🐈 \x00\x7f end<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    folder = st.write_synthetic_tokenizer(tmp_path_factory.mktemp("vocab"))
    return AutoTokenizer.from_pretrained(str(folder))


def test_it_has_exactly_the_models_ids_and_qwen3s_special_tokens(tokenizer):
    from minipaged.models.loader import resolve_model
    cfg = resolve_model("dummy:qwen3-0.6b").config
    vocab = tokenizer.get_vocab()
    assert len(tokenizer) == len(vocab) == QWEN3_VOCAB == cfg["vocab_size"]
    assert sorted(vocab.values()) == list(range(QWEN3_VOCAB))  # every id one token, no gaps
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == cfg["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"]) == [151643, 151644]
    assert tokenizer.bos_token_id is None
    byte_chars = st.bytes_to_unicode()
    assert tokenizer.convert_ids_to_tokens(list(range(256))) == [byte_chars[b] for b in range(256)]
    assert sum(len(t) >= 4 for t in vocab) > QWEN3_VOCAB // 2  # mostly multi-byte tokens


def test_text_round_trips_and_uses_multi_byte_tokens(tokenizer):
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
    english = TEXTS[1]
    assert len(tokenizer(english).input_ids) < len(english) / 2
    assert tokenizer("x<|im_end|>").input_ids[-1] == 151645  # a special token stays one id
    assert tokenizer(" the")["input_ids"] == [tokenizer.convert_tokens_to_ids("Ġthe")]


def test_xgrammar_reads_it_as_byte_level_and_compiles_the_benchmark_schema(tokenizer):
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=QWEN3_VOCAB,
                                              stop_token_ids=[151645])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.vocab_size == QWEN3_VOCAB
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    for token in tokenizer('[{"name": "Lily", "age": 7, "pets": ["cat"]}, {"name').input_ids:
        assert matcher.accept_token(token)
    assert not matcher.accept_token(tokenizer.convert_tokens_to_ids("x"))  # not after '"name'
    bitmask = xgr.allocate_token_bitmask(1, QWEN3_VOCAB)
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = [tokenizer.convert_tokens_to_ids(t) for t in ['"', '":']]
    words = bitmask[0].tolist()
    assert all(words[i // 32] >> (i % 32) & 1 for i in allowed)


def test_the_same_arguments_give_the_same_vocabulary():
    specials = {"<|eos|>": 1000}
    a = st.train_byte_level_bpe(3000, specials, seed=0)
    assert a == st.train_byte_level_bpe(3000, specials, seed=0)
    assert a != st.train_byte_level_bpe(3000, specials, seed=1)
    tokens, merges = a
    assert len(tokens) == len(set(tokens)) == 3000 and tokens[1000] == "<|eos|>"
    known = set(tokens)
    assert all(left in known and right in known and left + right in known
               for left, right in merges)


def test_bad_arguments_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be at least 256 \\+ 1"):
        st.train_byte_level_bpe(256, {"<|eos|>": 0})
    with pytest.raises(ValueError, match="'<|eos|>' has id 300, outside \\[0, 300\\)"):
        st.train_byte_level_bpe(300, {"<|eos|>": 300})
    with pytest.raises(ValueError, match="eos_token '</s>' is not one of the special tokens"):
        st.write_synthetic_tokenizer(tmp_path, 300, special_tokens={"<|eos|>": 299},
                                     eos_token="</s>")
    # a corpus with too few distinct pieces cannot give the size asked for: refused, not short
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(st, "synthetic_corpus", lambda n, seed: [" ab"] * n)
        with pytest.raises(ValueError, match="a corpus of 600 words gave 258 tokens, not 299"):
            st.train_byte_level_bpe(300, {"<|eos|>": 299})


def test_the_benchmarks_host_breakdown_runs_on_a_tiny_model_of_this_vocabulary(tmp_path):
    """`structured_outputs.py --tiny-model --async-scheduling --breakdown` (the host's grammar
    work per step without a GPU) times the engine's real methods: a rename would leave its
    columns at zero, so they must be filled for the constrained ways and empty for none; and
    its rounds alternate the order of the ways."""
    import subprocess
    out = tmp_path / "breakdown.json"
    subprocess.run([sys.executable, str(BENCH / "structured_outputs.py"), "--tiny-model",
                    "--async-scheduling", "--breakdown", "--num-requests", "8",
                    "--max-tokens", "12", "--runs", "2", "--out", str(out)], check=True,
                   capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    got = json.loads(out.read_text())
    assert got["async_scheduling"] is True and got["vocab_size"] == QWEN3_VOCAB
    ways = ["none", "all constrained", "half constrained"]
    assert got["order_by_round"] == [ways, ways[::-1]]  # the second round in reverse
    res = got["results"]
    assert all(len(r["ratio_to_none_per_round"]) == 2 for r in res.values())
    assert not any(res["none"]["host_ms_per_step"].values())
    for way in ("all constrained", "half constrained"):
        parts = res[way]["host_ms_per_step"]
        assert all(parts[k] > 0 for k in ("start", "batched accept", "fill wait", "token_mask",
                                           "sample_masked")), parts
        cpu = res[way]["host_cpu_ms_per_step"]
        assert all(0 <= cpu[k] <= parts[k] + 0.05 for k in parts) and cpu["start"] > 0, cpu
        assert res[way]["same-batch steps"] > 0 and res[way]["worker_fill_ms_median"] > 0
        assert res[way]["first_output"].startswith("[")
