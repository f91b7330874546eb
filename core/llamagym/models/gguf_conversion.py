"""GGUF files converted once into ordinary Hugging Face directories, and the check of a
converted copy against what was written.

transformers reads a GGUF file and dequantizes every tensor to float; the result is
rebuilt as a plain model, checked against the GGUF-loaded one on a fixed text, and saved
once as a safetensors directory in the LlamaGym cache, ``<cache>/models/gguf-<sha256
prefix>`` (:func:`convert_gguf`), so later loads are a plain ``from_pretrained(dir)``
and the model trains like any other float model. The cache is keyed by the file's
content: the GGUF file is hashed whenever it is loaded (:func:`gguf_digest`), so a file
changed in place, whatever its size and modification time, is converted again. The
converted copy records what it wrote (:func:`record_files`) and every byte of it is
checked against that record whenever it is used (:func:`conversion_damage`); a damaged
copy is converted again, with a warning.

Where the GGUF file comes from (a path, or a registry entry's wheel on PyPI) is the
business of :mod:`llamagym.models.sources`. Only the standard library is imported at
module level: the CLI reads whether a model is cached without loading torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from llamagym.errors import ModelLoadError
from llamagym.models.registry import list_model_entries
from llamagym.paths import (
    discard_directory,
    models_cache_dir,
    publish_directory,
    remove_stale_temp_dirs,
)
from llamagym.plugin_runtime.registry import ModelEntry

# The name these messages had before this module was split from sources.py: a filter or
# a log level set for it still applies.
logger = logging.getLogger("llamagym.models.sources")

GGUF_SUFFIX = ".gguf"
# Bump when the conversion changes, so directories written by an older LlamaGym are
# converted again rather than trusted. 2: the marker records the digests of the files.
CONVERSION_FORMAT = 2
# Written last into a converted directory: its presence means the directory is complete.
_MARKER_FILE = "llamagym_source.json"
HASH_CHUNK = 1 << 20
# A fixed text the GGUF-loaded model and its float rebuild both read before anything is
# cached: their logits must agree within CHECK_TOLERANCE. The marker file keeps what
# the GGUF-loaded model gave (argmax per position, and "first_logits": the logits of
# token ids 0..CHECK_SAMPLE-1 per position), so the cached copy can be checked
# against the original later without reading the GGUF file again.
CHECK_TEXT = "You are playing Blackjack. Your sum is 14 and the dealer shows 10. Hit or stick?"
CHECK_SAMPLE = 32
CHECK_TOLERANCE = 1e-4
# The marker records each file of a conversion as its size and the sha256 of each of its
# VERIFY_BLOCK-byte blocks, and every use checks every block (a block names where a
# change lies). A sample of 32 blocks missed a changed 1 MiB block of SmolLM2's 538 MB
# weights in 285 of 300 loads, and that copy gave NaN logits; reading all of it costs
# about 1.4 CPU-seconds per load.
VERIFY_BLOCK = 1 << 20
_convert_lock = threading.Lock()


# --------------------------------------------------------------------------
# The converted copy: where it is, whether it is complete, whether it is intact
# --------------------------------------------------------------------------


def models_dir(cache: Path | None) -> Path:
    """The ``models`` folder of a LlamaGym cache root (``None``: the default cache)."""
    return Path(cache) / "models" if cache is not None else models_cache_dir()


def converted_dir(sha256: str, cache: Path | None = None) -> Path:
    """Where the safetensors conversion of the GGUF file with this digest is cached.

    ``cache`` is a LlamaGym cache root; ``None`` means :func:`llamagym.paths.cache_dir`.
    """
    return models_dir(cache) / f"gguf-{sha256[:16]}"


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


def conversion_damage(directory: Path) -> str | None:
    """How a converted directory differs from what its marker records, or None.

    Checks that it holds exactly the recorded files, their sizes, and the digest of
    every block of each file: a missing, truncated, added or changed file (one byte
    of it) is found.
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
    for name, record in files.items():
        path, blocks = directory / name, record["blocks"]
        try:
            size = path.stat().st_size
            if size != record["size"]:
                return f"{name} is {size:,} bytes, {record['size']:,} were written"
            for index, digest in _block_digests(path, range(len(blocks))):
                if digest != blocks[index]:
                    start = index * VERIFY_BLOCK
                    end = min(start + VERIFY_BLOCK, size) - 1
                    return f"{name} differs from what was written (bytes {start:,}-{end:,})"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as error:
            return f"{name} cannot be read ({error.strerror or error})"
    return None


def intact_conversion(target: Path, sha256: str, source: str) -> bool:
    """True if ``target`` holds a finished conversion whose files are, byte for byte, as
    they were written. A damaged one is deleted, with a warning, so that it is
    converted again from ``source``."""
    if not is_converted(target, sha256):
        return False
    problem = conversion_damage(target)
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


# --------------------------------------------------------------------------
# Digests and temporary directories
# --------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    """The sha256 of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_digest(path: Path) -> str:
    """The sha256 of the GGUF file at ``path``: what its conversion is cached under.

    Read in full on every load: a size and a modification time say nothing of a file
    rewritten in place (both can be kept), and a digest remembered against them would
    hand out the conversion of the old content.
    """
    return sha256_of(Path(path).resolve())


def make_cache_dir(parent: Path) -> None:
    """Create ``parent`` (a folder of the cache), or say in one line how to fix it."""
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


def dtype_keyword() -> str:
    """The name of ``from_pretrained``'s dtype argument: transformers 4.56 renamed
    ``torch_dtype`` to ``dtype``; 5.x warns on the old name and older releases ignore
    the new one."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


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
) -> Path:
    """The cached safetensors directory for a GGUF file, converting it if needed.

    ``sha256`` is the file's digest when already known (else it is computed);
    ``origin`` is recorded in the directory's marker file. A cached copy whose files
    differ from what was written (every byte is checked) is converted again. The
    conversion is written to a temporary sibling directory and renamed into place, so a
    crash leaves nothing half-written, and when two processes convert at once the first rename
    wins. Takes under a minute on a CPU for a 135M-parameter model.
    """
    gguf_path = Path(gguf_path)
    digest = sha256 or gguf_digest(gguf_path)
    target = converted_dir(digest, cache)
    if intact_conversion(target, digest, gguf_path.name):
        return target
    require_gguf_package()
    parent = target.parent
    make_cache_dir(parent)
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
