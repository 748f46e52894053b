"""Loading a GGUF file (llama.cpp's format) straight into minipaged's Llama: `LLM("model.gguf")`.

    source = gguf_source("stories260K.gguf")       ModelSource: the config read from the header
    model.load_weights(iter_gguf_weights(path))    HF-named float tensors, dequantized one by one
    tokenizer = load_gguf_tokenizer(path)          the tokenizer the metadata describes

A GGUF is one file: a header of key/value metadata (the architecture, its sizes, the tokenizer's
vocabulary and merges), then the tensors, each in its own type: F32, F16, BF16, or blocks of 32
quantized values with a scale (Q8_0: int8 x f16 scale; Q4_0: 4-bit x f16 scale; the K-quants).
The `gguf` package (llama.cpp's own Python reader) memory-maps the file and dequantizes them.

Why load directly instead of converting to a cached HF folder (what hub.py does for the built-in
stories260K, through transformers' GGUF reader): a quantized file is the point of GGUF, and
converting it writes every weight back out as float32 (a 4 GB Q4_0 file becomes 28 GB of
safetensors in the cache) and needs transformers' model classes to name the tensors. Read
directly, each tensor is dequantized in memory and copied into the model in its dtype, the config
comes from the header before any weight is read (an architecture minipaged does not implement is
refused at once, naming it), and what the conversion does is three small tables below: the
config keys, the tensor names, and one row permutation. Only the tokenizer goes through
transformers (its GGUF tokenizer builders rebuild Llama's sentencepiece-BPE and the byte-level BPE
of Qwen from the metadata; there is nothing to gain by writing those again).

The permutation: llama.cpp's converter stores the Q and K rows of `llama` files permuted for its
RoPE, which rotates adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face's Llama (and
minipaged's, layers.py) rotates the two halves of each head (x_i, x_{i+d/2}) ("rotate_half").
`unpermute_qk` undoes it, head by head, so the file runs on the HF-layout RoPE unchanged. Qwen2
and Qwen3 files are written in the halves layout already (llama.cpp runs them with NEOX RoPE).

stories260K's GGUF writes context_length 2048 where the model was trained at 512: a file that is
one of hub.py's pinned models (same size and SHA-256) gets that model's `config_overrides`, so
`LLM("stories260K.gguf")` and `LLM("stories260K")` have the same config.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

# general.architecture -> (HF architecture, model_type, Q/K rows permuted by llama.cpp).
# Mistral's GGUF files say "llama" (llama.cpp runs them as Llama, and so does minipaged).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

# Tensor names: GGUF -> HF (the names `LlamaForCausalLM.load_weights` expects).
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_TENSORS = {  # blk.{i}.<gguf> -> model.layers.{i}.<hf>
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",   # Qwen3
    "attn_k_norm": "self_attn.k_norm",   # Qwen3
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

FLOAT_TYPES = ("F32", "F16", "BF16")  # read as they are; every other type is dequantized


class GGUFError(ValueError):
    """A GGUF file minipaged cannot run: an architecture, tensor, type or key it does not know."""


def is_gguf(model: str | os.PathLike) -> bool:
    """`model` names a GGUF file: it ends in .gguf, or it is a file starting with the magic."""
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _reader(path: Path):
    import gguf
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # not a GGUF, truncated, a version the reader does not know
        raise GGUFError(f"{path} could not be read as a GGUF file ({type(e).__name__}: {e})") from e


def _value(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def architecture_of(reader, path: Path) -> tuple[str, str, bool]:
    """(HF architecture, model_type, permuted Q/K) of the file, or a GGUFError naming it."""
    arch = _value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{path.name}: GGUF architecture {arch!r} (general.architecture) is not implemented by "
            f"minipaged, which runs the Llama family only: GGUF architectures "
            f"{sorted(GGUF_ARCHITECTURES)} (Llama and Mistral files say 'llama')")
    return GGUF_ARCHITECTURES[arch]


def gguf_config(path: str | os.PathLike) -> dict:
    """The Hugging Face `config.json` that the file's header describes (ModelConfig reads it)."""
    path = Path(path)
    reader = _reader(path)
    hf_arch, model_type, _ = architecture_of(reader, path)
    arch = _value(reader, "general.architecture")

    def key(name: str, default=None, required: bool = True):
        value = _value(reader, f"{arch}.{name}", default)
        if value is None and required:
            raise GGUFError(f"{path.name}: the header has no {arch}.{name}, which a {arch} model needs")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise GGUFError(f"{path.name} carries rope_freqs.weight (Llama 3.1-style per-frequency RoPE "
                        "factors), which minipaged's GGUF reader does not apply yet; load the "
                        "model's Hugging Face folder instead")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path.name} has no token_embd.weight tensor")
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads, required=False)
    rotary = key("rope.dimension_count", head_dim, required=False)
    if rotary != head_dim:
        raise GGUFError(f"{path.name}: RoPE on {rotary} of {head_dim} head dimensions "
                        f"({arch}.rope.dimension_count); minipaged rotates whole heads")
    scaling = key("rope.scaling.type", "none", required=False)
    if scaling == "none":
        rope_scaling = None
    elif scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    else:
        raise GGUFError(f"{path.name}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not "
                        "supported by the GGUF reader (supported: none, linear)")
    # The embedding's rows are the model's vocabulary (ggml lists dimensions fastest first).
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    # Generation stops at any of llama.cpp's end tokens (end of text, of turn, of message); an id
    # outside the vocabulary is llama.cpp's "none" (0xFFFFFFFF).
    special = [_value(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    eos = [i for i in dict.fromkeys(special) if i is not None and i < vocab_size]
    bos = _value(reader, "tokenizer.ggml.bos_token_id")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads, required=False),
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0, required=False)),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": bos if bos is not None and bos < vocab_size else None,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "dtype": _natural_dtype(reader),
    }
    known = _known_model(path)
    if known is not None:
        config.update(dict(known.config_overrides))
    return config


def _f32(value: float) -> float:
    """A float32 header value as the number it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _natural_dtype(reader) -> str:
    """The dtype "auto" picks: that of the float weights, float16 for quantized ones (llama.cpp's
    and vLLM's choice: the block scales are f16)."""
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if types - set(FLOAT_TYPES):
        return "float16"
    for name, dtype in (("BF16", "bfloat16"), ("F16", "float16")):
        if name in types:
            return dtype
    return "float32"


def _known_model(path: Path):
    """The hub.py model this file is (same size and SHA-256), or None."""
    import minipaged.models.hub as hub
    size = path.stat().st_size
    candidates = [m for m in hub.HUB_MODELS.values() if m.size == size]
    if not candidates:
        return None
    digest = hub.sha256_of(path)
    return next((m for m in candidates if m.sha256 == digest), None)


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, or a GGUFError."""
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight or bias
    parts = base.split(".")
    if len(parts) == 1 and base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{BLOCK_TENSORS[parts[2]]}.{suffix}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no place in minipaged's Llama")


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair 0: x0 x1, pair 1: x2 x3, ...)
    back to HF's (first half, second half). Works on weights (rows, in) and biases (rows,)."""
    rows = w.shape[0]
    # (heads, head_dim/2, 2, ...) in the file -> (heads, 2, head_dim/2, ...) for rotate_half
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def dequantize(tensor) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in numpy's (rows, columns) order: F32/F16/BF16 as they
    are stored, any quantized type as float32 through `gguf.quants.dequantize`."""
    import gguf
    kind = tensor.tensor_type.name
    shape = tuple(reversed([int(d) for d in tensor.shape]))  # ggml lists the fastest dim first
    data = np.array(tensor.data)  # a copy: the reader's memory map is read-only
    if kind in ("F32", "F16"):
        return torch.from_numpy(data).reshape(shape)
    if kind == "BF16":
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(shape)
    try:
        values = gguf.quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError as e:
        raise GGUFError(f"GGUF tensor {tensor.name!r} is stored as {kind}, which the gguf package "
                        f"cannot dequantize ({e})") from e
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def iter_gguf_weights(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of the file, dequantized one at a time, Q/K rows un-permuted."""
    path = Path(path)
    reader = _reader(path)
    _, _, permuted = architecture_of(reader, path)
    arch = _value(reader, "general.architecture")
    heads = _value(reader, f"{arch}.attention.head_count")
    kv_heads = _value(reader, f"{arch}.attention.head_count_kv", heads)
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        w = dequantize(tensor)
        if permuted and ".q_proj." in name:
            w = unpermute_qk(w, heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_qk(w, kv_heads)
        yield name, w


def load_gguf_tokenizer(path: str | os.PathLike, model_max_length: Optional[int] = None):
    """The fast tokenizer the file's metadata describes, built by transformers' GGUF builders.

    They read it from a GGUF file, so they get a copy of the header without the tensors (small:
    the vocabulary) and without the special-token ids that point outside the vocabulary
    (hub.unset_token_ids: llama.cpp writes 0xFFFFFFFF for "none", transformers would index with it).
    """
    import gguf
    from transformers import AutoTokenizer

    import minipaged.models.hub as hub

    path = Path(path)
    reader = _reader(path)
    drop = set(hub.unset_token_ids(reader))
    with tempfile.TemporaryDirectory() as tmp:
        header = Path(tmp) / path.name
        writer = gguf.GGUFWriter(header, arch=_value(reader, "general.architecture"),
                                 endianess=reader.endianess)
        for field in reader.fields.values():
            if field.name == "general.architecture" or field.name.startswith("GGUF.") \
                    or field.name in drop:
                continue  # the writer adds the first two itself
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
        return AutoTokenizer.from_pretrained(tmp, gguf_file=header.name, **kwargs)
