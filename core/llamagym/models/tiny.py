"""The offline default model, ``tiny``: a ~0.2M-parameter Llama built locally.

LlamaGym must run end to end (tests, CI, a first ``llamagym train``) on a
machine with no GPU and no access to the Hugging Face Hub. ``tiny`` fills that
role: a randomly initialised Llama-architecture causal LM plus a tokenizer
trained on the spot from a fixed corpus (``tiny_corpus.txt``, a data file of
this package). It builds in a couple of seconds, is cached on disk, and loads
through the ordinary ``AutoModelForCausalLM`` / ``AutoTokenizer`` path like any
Hub checkpoint.

Tokenizer design:

* Byte-level BPE. Every one of the 256 byte values is in the vocabulary, so any
  Unicode string an environment produces encodes losslessly; there is no
  ``<unk>`` to hide bugs in prompts.
* Digits are split one per token (``Digits(individual_digits=True)`` runs
  before the byte-level step). A model this small cannot memorise the meaning
  of hundreds of merged number tokens, but it can learn ten digit tokens and
  their positions, which is what observations like ``Your sum is 14`` or
  ``Pole angle: -0.031`` need.
* The vocabulary (~1024) is trained on words agents actually read and write
  (Blackjack, CartPole, text adventures, JSON actions), so prompts and answers
  are a few tokens each and the embedding table stays small.
* Chat formatting uses dedicated special tokens (``<|system|>``, ``<|user|>``,
  ``<|assistant|>``, ``<|end|>``) with ``<|end|>`` as eos, so an episode turn
  ends with one well-defined token the sampler can stop on.

Building is deterministic: the same ``seed`` yields byte-identical
``tokenizer.json`` and identical weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from llamagym.models.gguf_conversion import save_model_files
from llamagym.paths import (
    discard_directory,
    models_cache_dir,
    publish_directory,
    remove_stale_temp_dirs,
)

logger = logging.getLogger(__name__)

# Bump when the corpus, tokenizer settings or architecture change, so caches
# built by an older LlamaGym are not silently reused.
TINY_MODEL_VERSION = 1

PAD_TOKEN = "<|pad|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_TOKEN = "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN)

TARGET_VOCAB_SIZE = 1024

# Written out because the tokenizer's own role tokens are what the model sees.
# Unknown roles are an error rather than silently becoming an unseen token.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('tiny model chat template: unsupported role ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>\\n' -}}"
    "{%- endif -%}"
)

MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

# A marker written last inside the build directory; a target directory without
# it (or with another version or seed in it) is rebuilt.
_BUILD_INFO_FILE = "llamagym_tiny.json"
# Seeding torch's global RNG is process-wide, so two threads building at once
# could interleave their draws; processes are kept apart by the atomic rename.
_build_lock = threading.Lock()


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


def training_corpus() -> list[str]:
    """The fixed samples the tiny tokenizer is trained on (same list every call), read
    from ``tiny_corpus.txt``: every line but blank ones and ``#`` comments, with
    ``\\n`` standing for a line break."""
    text = (files("llamagym.models") / "tiny_corpus.txt").read_text(encoding="utf-8")
    return [
        line.replace("\\n", "\n")
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    ]


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------


def default_tiny_model_dir(seed: int = 0) -> Path:
    """Cache location of the tiny model for ``seed``."""
    return models_cache_dir() / f"tiny-v{TINY_MODEL_VERSION}-seed{seed}"


def build_tokenizer() -> Any:
    """Train the tiny byte-level BPE tokenizer; returns a ``PreTrainedTokenizerFast``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Only fixes offsets; it adds no bos/eos, so prompts are exactly what the
    # chat template renders.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes up front, so nothing is ever out of vocabulary.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=END_TOKEN,
        # GPT-2 style: the end token doubles as bos. It is never inserted
        # automatically; it only gives the model config a valid bos id.
        bos_token=END_TOKEN,
        additional_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@contextlib.contextmanager
def _no_transformers_progress_bars() -> Iterator[None]:
    """transformers draws no progress bar inside the block (``save_pretrained`` shows
    "Writing model shards" even for a one-file model that takes milliseconds to write).
    Where transformers has ``set_tqdm_hook``, only its own bars are replaced, and the
    previous hook comes back afterwards; elsewhere its switch is turned off and back."""
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    empty = getattr(hf_logging, "EmptyTqdm", None)
    if set_hook is not None and empty is not None:
        previous = set_hook(lambda factory, args, kwargs: empty(*args, **kwargs))
        try:
            yield
        finally:
            set_hook(previous)
        return
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _build_into(directory: Path, seed: int) -> None:
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_CONFIG,
    )
    # fork_rng keeps the caller's global RNG state untouched while the weight
    # init draws from a seeded stream.
    with _build_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # transformers wraps PreTrainedModel.to in a decorator whose stub hides its signature.
    model = model.to(torch.float32)  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _no_transformers_progress_bars():
        save_model_files(model, tokenizer, directory)
    # transformers 5 records its internal class name (TokenizersBackend);
    # PreTrainedTokenizerFast names the same thing and older releases know it.
    tokenizer_config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config_path.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    info = {
        "name": "tiny",
        "version": TINY_MODEL_VERSION,
        "seed": seed,
        "parameters": model.num_parameters(),
        "vocab_size": len(tokenizer),
    }
    # Written last: its presence means the directory is complete.
    (directory / _BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _is_complete(directory: Path, seed: int) -> bool:
    """True if ``directory`` holds a finished build of this version and seed."""
    try:
        info = json.loads((directory / _BUILD_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("version") == TINY_MODEL_VERSION and info.get("seed") == seed


def build_tiny_model(
    directory: Path | None = None, *, seed: int = 0, overwrite: bool = False
) -> Path:
    """Build the tiny model and tokenizer into ``directory`` (or reuse a cached build).

    The result loads with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``. The build happens in a temporary
    sibling directory that is renamed into place, so a crash never leaves a
    half-written model, and concurrent builders cannot corrupt each other: the
    first rename wins and later builders discard their copy.
    """
    target = Path(directory) if directory is not None else default_tiny_model_dir(seed)
    target = target.expanduser()
    if _is_complete(target, seed) and not overwrite:
        return target

    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{target.name}.tmp-"
    remove_stale_temp_dirs(parent, tmp_prefix)

    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
    try:
        _build_into(tmp, seed)
        # mkdtemp makes the directory private (0700); the finished model is
        # ordinary readable data like the rest of the cache.
        tmp.chmod(0o755)
        if overwrite and target.exists():
            # Publishing replaces only an incomplete build.
            discard_directory(target)
        # Another builder may have renamed its copy into place first; theirs is as good
        # as ours (same seed, same bytes).
        if not publish_directory(tmp, target, lambda found: _is_complete(found, seed)):
            logger.debug("tiny model already built at %s by another process", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model in %s (%.1fs)", target, time.perf_counter() - started)
    return target
