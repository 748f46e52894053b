"""Fetching a built-in model from the Hugging Face hub: download, SHA-256 check, GGUF -> HF folder.

    download_gguf_model(STORIES260K)     ~/.cache/minipaged/models/stories260K/hf, ready for LLM(...)

stories260K has no Hugging Face-format copy on the hub: its published form is ggml-org's GGUF,
`tinyllamas/stories260K.gguf` in `ggml-org/models` (mirrored in `ggml-org/models-moved`), F32,
pinned here by its SHA-256 and size. The steps, one function each:

1. `fetch_gguf`: `huggingface_hub.hf_hub_download` (with its tqdm progress bar) into a staging
   folder inside the models directory. The mirror is tried only when the first repo answers without
   the file; when the hub cannot be reached at all, a mirror on the same hub would not help.
2. `check_sha256`: size and SHA-256 must be the pinned ones, before anything reads the file. A
   mismatch raises `ChecksumError` naming both hashes, and the staging folder goes: nothing is cached.
3. `convert_gguf`: transformers' GGUF reader does the conversion: the config, the tensors (Q/K rows
   un-permuted from llama.cpp's interleaved-pair RoPE layout to HF's rotate_half one) and the
   tokenizer. One repair comes first (`drop_unset_token_ids`): the file sets its padding and
   separator ids to 0xFFFFFFFF, llama.cpp's "none", which transformers takes for a real id (its
   tokenizer raises IndexError, its config warns). `gguf`'s own `gguf-new-metadata` code writes a
   copy without those two keys, otherwise byte for byte the same.
4. The converted folder is renamed into place in one step, so a half-written model is never found.

The models directory (`models_dir`): `download_dir` when given, else $MINIPAGED_CACHE/models, else
~/.cache/minipaged/models. Inside it, the layout of the course's shared folder:

    stories260K/stories260K.gguf     the verified original
    stories260K/hf/                  config.json, model.safetensors, tokenizer.json, tokenizer_config.json
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class GGUFModel:
    """A model published on the hub as one GGUF file, pinned by its SHA-256."""

    name: str                      # the folder it gets: <models_dir>/<name>/hf
    repo_ids: tuple[str, ...]      # the repo, then its mirrors
    filename: str                  # the file's path inside each repo
    sha256: str
    size: int                      # bytes
    # Values the GGUF header has wrong for this model, set in the converted config.json.
    config_overrides: tuple[tuple[str, object], ...] = ()

    @property
    def gguf_name(self) -> str:
        return Path(self.filename).name

    def urls(self, revision: Optional[str] = None) -> list[str]:
        """Where a browser (or curl) gets the file: one URL per repo."""
        from huggingface_hub import hf_hub_url
        return [hf_hub_url(repo, self.filename, revision=revision) for repo in self.repo_ids]


STORIES260K = GGUFModel(
    name="stories260K",
    repo_ids=("ggml-org/models", "ggml-org/models-moved"),
    filename="tinyllamas/stories260K.gguf",
    sha256="270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d",
    size=1_185_376,
    # llama.cpp's llama2.c converter writes context_length 2048; the model was trained at 512
    # (llama2.c doc/stories260K.md), the value of the course's HF copy.
    config_overrides=(("max_position_embeddings", 512),),
)

HUB_MODELS = {"stories260k": STORIES260K}  # lower-cased name -> model


class ChecksumError(ValueError):
    """A downloaded or hand-placed file is not the pinned one."""


class HubUnavailableError(OSError):
    """The hub could not be reached, or no repo had the file (offline, unreachable, moved)."""


def models_dir(download_dir: Optional[str | os.PathLike] = None) -> Path:
    """Where downloaded models live: `download_dir`, $MINIPAGED_CACHE/models or ~/.cache/minipaged/models."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    cache = os.environ.get("MINIPAGED_CACHE") or Path.home() / ".cache" / "minipaged"
    return Path(cache).expanduser() / "models"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, model: GGUFModel) -> None:
    """Raise `ChecksumError` unless `path` is the file `model` pins (size, then SHA-256)."""
    size, digest = path.stat().st_size, sha256_of(path)
    if size != model.size or digest != model.sha256:
        raise ChecksumError(
            f"{path} is not {model.repo_ids[0]}/{model.filename}: its SHA-256 is {digest} "
            f"({size:,} bytes), expected {model.sha256} ({model.size:,} bytes); "
            "the download is corrupt or the file changed upstream")


def fetch_gguf(model: GGUFModel, local_dir: Path, revision: Optional[str] = None) -> Path:
    """Download `model`'s GGUF into `local_dir` with `hf_hub_download`; the path of the file."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    failures = []
    for repo_id in model.repo_ids:
        try:
            return Path(huggingface_hub.hf_hub_download(
                repo_id, model.filename, revision=revision, local_dir=local_dir))
        except LocalEntryNotFoundError as e:  # no network, hub unreachable, or HF_HUB_OFFLINE=1
            failures.append(f"{repo_id}: {_first_line(e)}")
            break
        except Exception as e:  # the hub answered without the file (moved, renamed, bad revision)
            failures.append(f"{repo_id}: {type(e).__name__}: {_first_line(e)}")
    raise HubUnavailableError("; ".join(failures))


def unset_token_ids(reader) -> list[str]:
    """The keys of the special-token ids (tokenizer.ggml.*_token_id) outside the vocabulary."""
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        return []
    vocab_size = len(tokens.data)
    return [name for name, field in reader.fields.items()
            if name.startswith("tokenizer.ggml.") and name.endswith("_token_id")
            and field.contents() >= vocab_size]


def drop_unset_token_ids(src: Path, dst: Path) -> Path:
    """`src`, or a copy at `dst` without the special-token ids that point outside the vocabulary."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    unset = unset_token_ids(reader)
    if not unset:
        return src
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents(),
                             endianess=reader.endianess)
    alignment = reader.get_field("general.alignment")
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    copy_with_new_metadata(reader, writer, {}, unset)
    return dst


def convert_gguf(gguf_file: Path, out_dir: Path,
                 config_overrides: tuple[tuple[str, object], ...] = ()) -> Path:
    """Write the HF folder of `gguf_file` (config.json, model.safetensors, tokenizer files)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        clean = drop_unset_token_ids(gguf_file, Path(tmp) / gguf_file.name)
        config = AutoConfig.from_pretrained(clean.parent, gguf_file=clean.name)
        for key, value in config_overrides:
            setattr(config, key, value)
        tokenizer = AutoTokenizer.from_pretrained(clean.parent, gguf_file=clean.name,
                                                  model_max_length=config.max_position_embeddings)
        # `from_pretrained(gguf_file=...)` would build the model too, but it requires `accelerate`;
        # the reader it calls needs only a model skeleton to name the tensors.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(clean), return_tensors=True, model_to_load=model)["tensors"]
        model.load_state_dict(tensors, strict=True, assign=True)  # every parameter, no stray tensor
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for f in out_dir.iterdir():  # safetensors writes 0600; the cache may be shared (--download-dir)
        f.chmod(0o644)
    return out_dir


def install_gguf(model: GGUFModel, gguf_file: Path, download_dir=None) -> Path:
    """Check and convert a GGUF already on disk into `<models_dir>/<name>/hf`; that folder."""
    check_sha256(gguf_file, model)
    root = models_dir(download_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=root))
    try:
        convert_gguf(gguf_file, staging / "hf", model.config_overrides)
        return _move_into_place(model, staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_gguf_model(model: GGUFModel, download_dir=None, revision: Optional[str] = None) -> Path:
    """Fetch, check and convert `model` into `<models_dir>/<name>/hf`; that folder.

    A folder already there is returned as it is, and a GGUF already at `<name>/<gguf_name>`
    (put there by hand on an offline machine) is converted without fetching. On any failure the
    staging folder is removed, so the cache holds either the whole model or nothing of it.
    """
    root = models_dir(download_dir)
    if (root / model.name / "hf" / "config.json").is_file():
        return root / model.name / "hf"
    if (root / model.name / model.gguf_name).is_file():
        return install_gguf(model, root / model.name / model.gguf_name, download_dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"{model.name}: fetching {model.repo_ids[0]}/{model.filename} ({model.size:,} bytes) "
          f"from the Hugging Face hub into {root / model.name}", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=root))
    try:
        gguf_file = fetch_gguf(model, staging / "download", revision)
        check_sha256(gguf_file, model)
        os.replace(gguf_file, staging / model.gguf_name)
        convert_gguf(staging / model.gguf_name, staging / "hf", model.config_overrides)
        return _move_into_place(model, staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_into_place(model: GGUFModel, staging: Path, root: Path) -> Path:
    """Rename `staging/hf` (and the GGUF, if staged) to `root/<name>/`; a folder there stays."""
    final = root / model.name
    final.mkdir(exist_ok=True)
    if (staging / model.gguf_name).is_file() and not (final / model.gguf_name).exists():
        os.replace(staging / model.gguf_name, final / model.gguf_name)
    if not (final / "hf" / "config.json").is_file():  # another process may have finished first
        shutil.rmtree(final / "hf", ignore_errors=True)
        os.replace(staging / "hf", final / "hf")
    return final / "hf"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
