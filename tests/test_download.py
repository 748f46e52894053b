"""stories260K arrives by itself: hub fetch (faked here), SHA-256 check, GGUF -> HF conversion,
the offline error, and `minipaged download`.

The conversion runs for real on the course's copy of ggml-org's GGUF (found on the model search
path, like every stories260K test; skipped without it). No test here touches the network: the
download function is replaced, or the hub is put in offline mode.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

from helpers import STORIES_EXPECTED
from minipaged import LLM, SamplingParams
from minipaged.cli import main as cli_main
from minipaged.models import hub, loader, source
from minipaged.models.loader import resolve_model

SPEC = hub.STORIES260K
SOURCE_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
               "in the park. One day, she saw a big, red ball.")  # SOURCE.md, greedy, 40 tokens
NOPAD_SHA256 = "d46ebfdf179589528870956047ff14ac9e574a5274e25108ea1a4e6b869c3d2d"  # SOURCE.md


def course_file(relative: str) -> Path:
    """A file of the course's shared folder, found on the model search path (not in the cache)."""
    bases = [b for b in loader.model_search_path() if b != hub.models_dir().resolve()]
    for base in bases:
        if (base / relative).exists():
            return base / relative
    pytest.skip(f"the course's shared folder is absent: no {relative} in any of "
                f"{[str(b) for b in bases]}")


@pytest.fixture(scope="module")
def shared_gguf() -> Path:
    return course_file(f"{SPEC.name}/{SPEC.gguf_name}")


@pytest.fixture(scope="module")
def shared_hf() -> Path:
    return course_file(f"{SPEC.name}/hf/config.json").parent


@pytest.fixture(scope="module")
def converted(shared_gguf, tmp_path_factory) -> Path:
    """The course's GGUF, checked and converted into a fresh models directory."""
    return hub.install_gguf(SPEC, shared_gguf, tmp_path_factory.mktemp("models"))


@pytest.fixture
def empty_search_path(monkeypatch, tmp_path) -> Path:
    """Nothing on the search path, the cache in tmp_path; returns the models directory."""
    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("MINIPAGED_MODEL_PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(source, "shared_model_dirs", lambda: [])
    return tmp_path / "cache" / "models"


class FakeHub:
    """Stands in for `huggingface_hub.hf_hub_download`: 'downloads' a local file into local_dir."""

    def __init__(self, source: Path, corrupt: bool = False, missing_in=(), offline=False):
        self.source, self.corrupt, self.missing_in, self.offline = source, corrupt, missing_in, offline
        self.calls: list[tuple[str, str | None]] = []

    def __call__(self, repo_id, filename, *, revision=None, local_dir=None, **kwargs):
        self.calls.append((repo_id, revision))
        if self.offline:
            raise LocalEntryNotFoundError("cannot reach the hub (test)")
        if repo_id in self.missing_in:
            raise EntryNotFoundError(f"{filename} is not in {repo_id} (test)")
        dst = Path(local_dir) / filename
        dst.parent.mkdir(parents=True, exist_ok=True)
        data = bytearray(self.source.read_bytes())
        if self.corrupt:
            data[len(data) // 2] ^= 0xFF  # one flipped byte in the tensor data
        dst.write_bytes(bytes(data))
        return str(dst)


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


# --- the conversion (transformers' GGUF reader) ------------------------------------------------

def test_converted_folder_has_the_hf_layout(converted):
    assert converted.name == "hf" and converted.parent.name == SPEC.name
    for name in loader.HF_FILES:
        assert (converted / name).is_file(), name
    source = resolve_model(str(converted))
    assert source.config["max_position_embeddings"] == 512  # the training context, not the 2048 header
    assert source.config["pad_token_id"] is None


def test_converted_weights_equal_the_shipped_ones(converted, shared_hf):
    import torch
    ours = dict(loader.iter_safetensors(converted))
    ref = dict(loader.iter_safetensors(shared_hf))
    assert set(ours) == set(ref) | {"lm_head.weight"}  # the GGUF stores output.weight apart
    for name, tensor in ref.items():  # Q/K rows un-permuted into HF's rotate_half layout
        assert torch.equal(ours[name], tensor), name
    assert torch.equal(ours["lm_head.weight"], ref["model.embed_tokens.weight"])


def test_converted_model_generates_the_reference_story(converted, shared_hf):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    ours = LLM(str(converted), device="cpu").generate("Once upon a time", params, use_tqdm=False)[0]
    ref = LLM(str(shared_hf), device="cpu").generate("Once upon a time", params, use_tqdm=False)[0]
    assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
    assert ours.prompt_token_ids + list(ours.outputs[0].token_ids) == STORIES_EXPECTED
    assert ours.prompt + ours.outputs[0].text == SOURCE_TEXT


@pytest.mark.parametrize("text", ["Once upon a time", "Hello, world! 123 ünïcødé 日本",
                                  " leading space", "  two", "a\nb\tc", "Lily's dog said \"hi\"."])
def test_converted_tokenizer_matches_the_shipped_one(converted, shared_hf, text):
    from transformers import AutoTokenizer
    ours, ref = AutoTokenizer.from_pretrained(str(converted)), AutoTokenizer.from_pretrained(str(shared_hf))
    ids = ref(text).input_ids
    assert ours(text).input_ids == ids and ids[0] == 1  # BOS added, no EOS
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_unset_token_ids_are_dropped_and_nothing_else(shared_gguf, tmp_path):
    # Only the 0xFFFFFFFF padding/separator ids go: the copy is the course's stories260K.nopad.gguf.
    out = hub.drop_unset_token_ids(shared_gguf, tmp_path / "clean.gguf")
    assert out == tmp_path / "clean.gguf"
    assert hub.sha256_of(out) == NOPAD_SHA256
    assert hub.drop_unset_token_ids(out, tmp_path / "again.gguf") == out  # a clean file is kept


# --- the fetch path, with the download function faked --------------------------------------------

def test_llm_fetches_checks_and_converts_when_nothing_is_local(
        monkeypatch, empty_search_path, shared_gguf):
    fake = FakeHub(shared_gguf)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    path = resolve_model("stories260K", revision="some-rev").path
    assert path == empty_search_path / SPEC.name / "hf"
    assert fake.calls == [("ggml-org/models", "some-rev")]
    assert hub.sha256_of(empty_search_path / SPEC.name / SPEC.gguf_name) == SPEC.sha256
    # only the model is left in the cache: no staging folder, no hub bookkeeping
    assert sorted(p.name for p in (empty_search_path).iterdir()) == [SPEC.name]
    assert sorted(p.name for p in (empty_search_path / SPEC.name).iterdir()) == ["hf", SPEC.gguf_name]

    fake.offline = True  # the second run finds the cache and never calls the hub
    out = LLM("stories260K", device="cpu").generate(
        "Once upon a time", SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    assert out.prompt_token_ids + list(out.outputs[0].token_ids) == STORIES_EXPECTED
    assert len(fake.calls) == 1


def test_a_corrupt_download_is_an_error_naming_both_hashes_and_nothing_is_cached(
        monkeypatch, empty_search_path, shared_gguf):
    fake = FakeHub(shared_gguf, corrupt=True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    data = bytearray(shared_gguf.read_bytes())
    data[len(data) // 2] ^= 0xFF
    import hashlib
    bad = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(hub.ChecksumError) as e:
        resolve_model("stories260K")
    assert SPEC.sha256 in str(e.value) and bad in str(e.value)
    assert files_under(empty_search_path) == []
    assert not (empty_search_path / SPEC.name).exists()


def test_the_mirror_is_tried_when_the_repo_lacks_the_file(monkeypatch, tmp_path, shared_gguf):
    fake = FakeHub(shared_gguf, missing_in=("ggml-org/models",))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    path = hub.download_gguf_model(SPEC, tmp_path)
    assert path == tmp_path / SPEC.name / "hf"
    assert [repo for repo, _ in fake.calls] == ["ggml-org/models", "ggml-org/models-moved"]


def test_an_unreachable_hub_is_not_asked_twice(monkeypatch, tmp_path, shared_gguf):
    fake = FakeHub(shared_gguf, offline=True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    with pytest.raises(hub.HubUnavailableError, match="cannot reach the hub"):
        hub.download_gguf_model(SPEC, tmp_path)
    assert [repo for repo, _ in fake.calls] == ["ggml-org/models"]
    assert files_under(tmp_path) == []


def test_a_gguf_put_in_the_cache_by_hand_is_converted_offline(
        monkeypatch, empty_search_path, shared_gguf):
    fake = FakeHub(shared_gguf, offline=True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    (empty_search_path / SPEC.name).mkdir(parents=True)
    shutil.copy(shared_gguf, empty_search_path / SPEC.name / SPEC.gguf_name)
    assert resolve_model("stories260K").path == empty_search_path / SPEC.name / "hf"
    assert fake.calls == []


# --- offline: what the user is told --------------------------------------------------------------

def test_offline_error_names_the_files_the_urls_and_where_to_put_them(monkeypatch, empty_search_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import
    with pytest.raises(FileNotFoundError) as e:
        LLM("stories260K", device="cpu")
    msg = str(e.value)
    target = empty_search_path / SPEC.name
    for expected in [
        "https://huggingface.co/ggml-org/models/resolve/main/tinyllamas/stories260K.gguf",
        "https://huggingface.co/ggml-org/models-moved/resolve/main/tinyllamas/stories260K.gguf",
        SPEC.sha256, "1,185,376 bytes",
        str(target / SPEC.gguf_name), str(target / "hf"),
        "MINIPAGED_MODEL_PATH", "minipaged download stories260K",
        *loader.HF_FILES,
        str(Path(os.environ["MINIPAGED_MODEL_PATH"]) / SPEC.name / "hf"),  # where it looked
    ]:
        assert expected in msg, expected
    assert files_under(empty_search_path) == []


# --- minipaged download --------------------------------------------------------------------------

def test_cli_download_prints_where_the_model_lives(monkeypatch, tmp_path, shared_gguf, capsys):
    fake = FakeHub(shared_gguf)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    argv = ["download", "stories260K", "--download-dir", str(tmp_path), "--revision", "v1"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert f"stories260K is in {tmp_path / SPEC.name / 'hf'}" in out
    assert f"MINIPAGED_MODEL_PATH={tmp_path.resolve()}" in out
    assert fake.calls == [("ggml-org/models", "v1")]
    assert cli_main(argv) == 0 and len(fake.calls) == 1  # already there: nothing fetched


def test_cli_download_corrupt_is_one_error_line_and_status_2(monkeypatch, tmp_path, shared_gguf, capsys):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", FakeHub(shared_gguf, corrupt=True))
    assert cli_main(["download", "stories260K", "--download-dir", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # "fetching ...", bars, the error
    assert [line for line in lines if "error" in line] == lines[-1:]
    assert lines[-1].startswith("error: ") and SPEC.sha256 in lines[-1]
    assert files_under(tmp_path) == []


def test_cli_download_offline_says_what_to_fetch_and_where(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINIPAGED_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "minipaged.cli", "download", "stories260K"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: could not fetch stories260K")
    assert "https://huggingface.co/ggml-org/models/resolve/main/tinyllamas/stories260K.gguf" in err
    assert str(tmp_path / "models" / SPEC.name / SPEC.gguf_name) in err and SPEC.sha256 in err
    assert files_under(tmp_path) == []


def test_cli_download_unknown_hub_id_offline(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cli_main(["download", "no-such-org/no-such-model", "--download-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "no-such-org/no-such-model" in err
