"""Model loading: the offline ``tiny`` model, the registry, LoRA and quantization.

Everything here runs offline: the Hub is switched to offline mode for every
test and the LlamaGym cache points at a temporary directory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llamagym.errors import LlamaGymError, ModelLoadError
from llamagym.models.loading import (
    MAX_MODEL_TEXT_BYTES,
    _prepare_tokenizer,
    linear_module_names,
    load_model_and_tokenizer,
    resolve_device,
    resolve_dtype,
)
from llamagym.models.registry import (
    GENERIC_CHAT_TEMPLATE,
    PHI2_CHAT_TEMPLATE,
    get_model_entry,
    list_model_entries,
    register_model_entry,
)
from llamagym.models.tiny import (
    CHAT_TEMPLATE,
    END_TOKEN,
    PAD_TOKEN,
    build_tiny_model,
    default_tiny_model_dir,
)
from llamagym.paths import cache_dir
from llamagym.plugin_runtime.registry import ModelEntry

REQUIRED_HUB_IDS = {
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "microsoft/phi-2",
    "microsoft/Phi-3-mini-4k-instruct",
    "HuggingFaceTB/SmolLM-1.7B-Instruct",
    "Qwen/Qwen2-1.5B-Instruct",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "meta-llama/Llama-2-7b-chat-hf",
}


@pytest.fixture(autouse=True)
def _offline_and_private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE once at import, so the constant is
    # patched too; with it set, any HTTP request raises instead of connecting.
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("LLAMAGYM_CACHE", str(tmp_path / "llamagym-cache"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny build shared by the tests that only read it."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


# --------------------------------------------------------------------------
# The tiny model
# --------------------------------------------------------------------------


def test_cache_dir_follows_env(tmp_path: Path) -> None:
    assert cache_dir() == tmp_path / "llamagym-cache"
    assert default_tiny_model_dir(3) == tmp_path / "llamagym-cache" / "models" / "tiny-v1-seed3"


def test_tiny_build_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    for name in ("cache-a", "cache-b"):
        monkeypatch.setenv("LLAMAGYM_CACHE", str(tmp_path / name))
        path = build_tiny_model()
        assert path == tmp_path / name / "models" / "tiny-v1-seed0"
        built.append(path)
    first, second = built
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    weights_a = load_file(first / "model.safetensors")
    weights_b = load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        assert torch.equal(weights_a[key], weights_b[key]), key
    # No temporary build directories are left next to the result.
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_tiny_seed_changes_weights_not_tokenizer(tmp_path: Path, tiny_dir: Path) -> None:
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        load_file(other / "model.safetensors")[key], load_file(tiny_dir / "model.safetensors")[key]
    )


def test_tiny_build_is_cached_and_can_be_overwritten(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    build_tiny_model(target)
    marker = target / "stale-marker"
    marker.write_text("left by an earlier build")
    assert build_tiny_model(target) == target
    assert marker.exists(), "a complete cached build must be reused, not rebuilt"
    assert build_tiny_model(target, overwrite=True) == target
    assert not marker.exists()
    assert (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_incomplete_target_is_rebuilt(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")  # e.g. left by a copy that was interrupted
    build_tiny_model(target)
    AutoModelForCausalLM.from_pretrained(target)


def test_directory_with_another_seed_is_rebuilt(tmp_path: Path, tiny_dir: Path) -> None:
    target = tmp_path / "tiny"
    build_tiny_model(target, seed=5)
    build_tiny_model(target, seed=0)
    assert (target / "model.safetensors").read_bytes() == (
        tiny_dir / "model.safetensors"
    ).read_bytes()


def test_unwritable_cache_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LLAMAGYM_CACHE", str(blocker / "cache"))
    with pytest.raises(ModelLoadError, match="could not build the tiny model.*LLAMAGYM_CACHE"):
        load_model_and_tokenizer("tiny")


def test_concurrent_builders_do_not_corrupt_each_other(tmp_path: Path, tiny_dir: Path) -> None:
    target = tmp_path / "shared"
    errors: list[BaseException] = []

    def build() -> None:
        try:
            build_tiny_model(target)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]
    assert (target / "model.safetensors").read_bytes() == (
        tiny_dir / "model.safetensors"
    ).read_bytes()


_BUILD_AS_RANK = """
import sys, torch.distributed as dist
from llamagym.models.tiny import build_tiny_model
rank, store, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
build_tiny_model(__import__("pathlib").Path(target) / f"rank-{rank}")
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_every_rank_of_a_distributed_run_builds_a_whole_model(tmp_path: Path) -> None:
    # transformers saves weights only on rank 0 once torch.distributed is up; each
    # process of a multi-process run builds its own cache copy and must write them all.
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen([sys.executable, "-c", _BUILD_AS_RANK, str(r), str(store), str(tmp_path)])
        for r in (0, 1)
    ]
    assert [process.wait(timeout=300) for process in ranks] == [0, 0]
    for rank in (0, 1):
        directory = tmp_path / f"rank-{rank}"
        assert (directory / "config.json").is_file()
        assert (directory / "model.safetensors").is_file()
        assert AutoConfig.from_pretrained(directory).model_type == "llama"


def test_a_save_without_weights_is_not_cached(tmp_path: Path, tiny_dir: Path) -> None:
    from llamagym.models.gguf_conversion import save_model_files

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.save_pretrained = lambda directory: model.config.save_pretrained(directory)
    with pytest.raises(ModelLoadError, match="wrote no model.safetensors; nothing was cached"):
        save_model_files(model, AutoTokenizer.from_pretrained(tiny_dir), tmp_path)
    assert "should_save_on_this_rank" not in vars(model)  # transformers' own rule is back


def test_tiny_loads_from_local_directory(tiny_dir: Path) -> None:
    model, tokenizer = load_model_and_tokenizer(str(tiny_dir), device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert len(tokenizer) == model.config.vocab_size == 1024
    assert 150_000 < model.num_parameters() < 300_000
    assert not model.config.tie_word_embeddings
    # Small enough to train fully: no adapter, every weight trainable.
    assert all(p.requires_grad for p in model.parameters())
    assert tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token == END_TOKEN
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Your sum is 14. Hit or stick?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_tiny_by_name_uses_the_cache(tmp_path: Path) -> None:
    model, tokenizer = load_model_and_tokenizer("tiny", device="auto", seed=0)
    assert (tmp_path / "llamagym-cache" / "models" / "tiny-v1-seed0" / "config.json").is_file()
    assert model.device.type == "cpu"
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_auto_classes_load_the_files(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "llama"
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") != tokenizer.unk_token_id


def test_digits_are_single_tokens(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for number in ("0", "7", "14", "1234567890", "-0.031"):
        tokens = tokenizer.tokenize(number)
        assert [t for t in tokens if any(c.isdigit() for c in t)] == [
            c for c in number if c.isdigit()
        ]
    ids = tokenizer.encode("Your sum is 21", add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[-2:] == ["2", "1"]
    # Common agent vocabulary was learned as whole tokens.
    assert len(tokenizer.encode('{"action": "hit"}', add_special_tokens=False)) <= 8


@pytest.mark.parametrize("text", ["héllo wörld", "日本語 🤖", "tab\there\nnewline", ""])
def test_any_unicode_round_trips(tiny_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_with_generation_prompt(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "You play Blackjack."},
        {"role": "user", "content": "Your sum is 14."},
        {"role": "assistant", "content": '{"action": "hit"}'},
        {"role": "user", "content": "Your sum is 20."},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|system|>\nYou play Blackjack.<|end|>\n"
        "<|user|>\nYour sum is 14.<|end|>\n"
        '<|assistant|>\n{"action": "hit"}<|end|>\n'
        "<|user|>\nYour sum is 20.<|end|>\n"
        "<|assistant|>\n"
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == text.removesuffix("<|assistant|>\n")

    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|system|>")
    assert tokenizer.decode(ids) == text
    # Role and end markers are single special tokens, not spelled out.
    assert ids.count(tokenizer.eos_token_id) == 4


# --------------------------------------------------------------------------
# Errors a user sees
# --------------------------------------------------------------------------


def test_unknown_hub_id_offline_gives_one_clear_line() -> None:
    with pytest.raises(ModelLoadError) as caught:
        load_model_and_tokenizer("no-such-owner/no-such-model", device="cpu")
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        "could not load model 'no-such-owner/no-such-model': not a local directory and not "
        "reachable on the Hugging Face Hub (offline?). Use --model tiny or a local path."
    )
    assert isinstance(caught.value, LlamaGymError)


def test_registry_short_name_offline_names_the_hub_id() -> None:
    with pytest.raises(ModelLoadError, match=r"'phi-2' \(microsoft/phi-2\).*offline\?"):
        load_model_and_tokenizer("phi-2", device="cpu")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("not a valid id!!", "not a valid Hugging Face Hub id"),
        ("./definitely/missing/dir", "no such directory"),
    ],
)
def test_bad_names_are_rejected(name: str, expected: str) -> None:
    with pytest.raises(ModelLoadError, match=expected):
        load_model_and_tokenizer(name, device="cpu")


def test_broken_local_directory_is_reported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="could not load model from local directory"):
        load_model_and_tokenizer(str(tmp_path), device="cpu")


@pytest.mark.parametrize(
    ("name", "make", "says"),
    [
        ("config.json", lambda p: os.mkfifo(p), "'config.json' is a FIFO (named pipe)"),
        ("tokenizer_config.json", lambda p: os.mkfifo(p), "is a FIFO (named pipe)"),
        ("config.json", lambda p: p.symlink_to("/dev/zero"), "is a character device"),
        ("tokenizer.json", lambda p: p.symlink_to("/dev/zero"), "is a character device"),
        ("chat_template.jinja", lambda p: os.truncate(p, MAX_MODEL_TEXT_BYTES + 1),
         f"holds {MAX_MODEL_TEXT_BYTES + 1:,} bytes"),
    ],
)
def test_a_model_directory_file_that_is_no_file_is_refused_unread(
    name: str, make: Any, says: str, tiny_dir: Path, tmp_path: Path
) -> None:
    # A pipe would keep the loader waiting and /dev/zero reading without end.
    copy = tmp_path / "model"
    shutil.copytree(tiny_dir, copy)
    if not name.endswith(".jinja"):
        (copy / name).unlink()
    make(copy / name)
    with pytest.raises(ModelLoadError, match="from local directory") as refused:
        load_model_and_tokenizer(str(copy), device="cpu")
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_directory_of_links_to_files_loads(tiny_dir: Path, tmp_path: Path) -> None:
    # The Hub's cache is a folder of links to its blobs.
    linked = tmp_path / "linked"
    linked.mkdir()
    for file in tiny_dir.iterdir():
        (linked / file.name).symlink_to(file)
    model, _ = load_model_and_tokenizer(str(linked), device="cpu", lora=False)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_bad_options_name_the_allowed_values(tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="4bit, 8bit"):
        load_model_and_tokenizer(str(tiny_dir), quantize="2bit")
    with pytest.raises(ModelLoadError, match="float32, bfloat16, float16"):
        load_model_and_tokenizer(str(tiny_dir), dtype="float8")
    with pytest.raises(ModelLoadError, match="cannot be fully fine-tuned"):
        load_model_and_tokenizer(str(tiny_dir), quantize="4bit", lora=False)


def test_missing_bitsandbytes_says_how_to_install(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object, **kwargs: object) -> object:
        return None if name == "bitsandbytes" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match="pip install bitsandbytes"):
        load_model_and_tokenizer(str(tiny_dir), quantize="8bit")


def test_device_and_dtype_resolution() -> None:
    assert resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert resolve_device("auto") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ModelLoadError, match="unknown device"):
        resolve_device("tpu-please")
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cpu", preferred="bfloat16") == torch.float32
    assert resolve_dtype("auto", "mps") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16


# --------------------------------------------------------------------------
# Registry and LoRA
# --------------------------------------------------------------------------


def test_registry_has_the_documented_models() -> None:
    hub_ids = {entry.hub_id for entry in list_model_entries()}
    assert hub_ids >= REQUIRED_HUB_IDS
    assert get_model_entry("tiny") is not None
    assert get_model_entry("MICROSOFT/PHI-2") is get_model_entry("phi-2")
    phi2 = get_model_entry("microsoft/phi-2")
    assert phi2 is not None and phi2.chat_template_fallback
    assert get_model_entry("nobody/nothing") is None


def _tiny_model_of(architecture: str) -> torch.nn.Module:
    config = AutoConfig.for_model(
        architecture,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("entry", list_model_entries(), ids=lambda entry: entry.name)
def test_registry_lora_targets_exist_in_that_architecture(entry: ModelEntry) -> None:
    present = linear_module_names(_tiny_model_of(entry.architecture))
    missing = set(entry.lora_target_modules) - present
    assert not missing, f"{entry.name}: {sorted(missing)} not among {sorted(present)}"


def test_lora_targets_are_inferred_without_an_entry(tmp_path: Path, tiny_dir: Path) -> None:
    # A local Phi-3-style checkpoint matches no registry entry, so the fused
    # qkv_proj / gate_up_proj names must be found by inspecting the model.
    _tiny_model_of("phi3").save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path)
    model, _ = load_model_and_tokenizer(str(tmp_path), lora=True, lora_rank=2)
    adapted = {
        name.split(".lora_A.")[0].rsplit(".", 1)[-1]
        for name, _ in model.named_parameters()
        if ".lora_A." in name
    }
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_lora_on_the_tiny_model(tiny_dir: Path) -> None:
    model, _ = load_model_and_tokenizer(str(tiny_dir), lora=True, lora_rank=4, seed=1)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    q_lora_a = next(p for n, p in model.named_parameters() if "q_proj.lora_A" in n)
    assert q_lora_a.shape[0] == 4
    again, _ = load_model_and_tokenizer(str(tiny_dir), lora=True, lora_rank=4, seed=1)
    q_again = next(p for n, p in again.named_parameters() if "q_proj.lora_A" in n)
    assert torch.equal(q_lora_a, q_again), "the seed makes the adapter init reproducible"


def test_register_model_entry() -> None:
    entry = ModelEntry(
        name="my-model",
        hub_id="Me/My-Model",
        architecture="llama",
        parameters="10M",
        suggested_memory="tiny",
        lora_target_modules=("q_proj", "v_proj"),
    )
    register_model_entry(entry)
    register_model_entry(entry)  # identical re-registration is fine
    assert get_model_entry("me/my-model") is entry
    clash = ModelEntry(**{**entry.__dict__, "lora_rank": 4})
    with pytest.raises(ValueError, match="clashes"):
        register_model_entry(clash)
    register_model_entry(clash, overwrite=True)
    assert get_model_entry("my-model") is clash


def test_missing_chat_template_gets_a_fallback(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = None
    with caplog.at_level(logging.WARNING, logger="llamagym.models.loading"):
        _prepare_tokenizer(tokenizer, None, "some/model")
    assert tokenizer.chat_template == GENERIC_CHAT_TEMPLATE
    assert "no chat template" in caplog.text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "User: hi\nAssistant:"

    tokenizer.chat_template = None
    _prepare_tokenizer(tokenizer, get_model_entry("phi-2"), "microsoft/phi-2")
    assert tokenizer.chat_template == PHI2_CHAT_TEMPLATE
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == "Instruct: Be brief.\nhi\nOutput:"


def test_missing_pad_token_falls_back_to_eos(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.pad_token = None
    assert _prepare_tokenizer(tokenizer, None, "x") is False
    assert tokenizer.pad_token == tokenizer.eos_token


# --------------------------------------------------------------------------
# Quantized LoRA training on CPU
# --------------------------------------------------------------------------


def _bitsandbytes_skip_reason() -> str | None:
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot run here"
        return f"bitsandbytes cannot load on this machine: {exc}"
    return None


@pytest.mark.parametrize("quantize", ["4bit", "8bit"])
def test_quantized_lora_trains_one_step_on_cpu(tiny_dir: Path, quantize: str) -> None:
    reason = _bitsandbytes_skip_reason()
    if reason:
        pytest.skip(reason)
    model, tokenizer = load_model_and_tokenizer(str(tiny_dir), device="cpu", quantize=quantize)
    assert type(model).__name__ == "PeftModelForCausalLM"  # lora=None means LoRA when quantized
    layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(layer).__name__ == ("Linear4bit" if quantize == "4bit" else "Linear8bitLt")

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before_trainable = {n: p.detach().clone() for n, p in trainable.items()}
    before_frozen = {n: p.detach().clone() for n, p in frozen.items()}

    model.train()
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    batch = tokenizer(
        ["Your sum is 14. Action: hit", "Pole angle: 0.03. Action: LEFT"],
        return_tensors="pt",
        padding=True,
    )
    out = model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss)
    out.loss.backward()
    optimizer.step()

    changed = [n for n, p in trainable.items() if not torch.equal(p.detach(), before_trainable[n])]
    assert any("lora_B" in n for n in changed), "the adapter must move after one step"
    for name, param in frozen.items():
        assert torch.equal(param.detach(), before_frozen[name]), f"{name} is frozen but changed"
