"""`llamagym export`: a trained agent leaves as a directory that plain transformers and
peft load, in a process that never imports llamagym, and choose the same greedy
actions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llamagym import load_agent, load_model_and_tokenizer
from llamagym.testing import one_error_line

FAST = [
    "-n", "32", "--num-envs", "8", "--eval-episodes", "100", "--quiet",
    "--set", "algorithm.episodes_per_update=16", "--set", "algorithm.minibatch_size=16",
]

# Loads the export with transformers (and peft) alone and scores every candidate action
# the way score mode does: the mean log-probability of its tokens after the prompt.
PLAIN_TRANSFORMERS = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

# weights: "full", "adapter" (the card's first way), or the base model's directory (the
# card's offline way: the adapter put on a base loaded from disk).
directory, cases_file, weights = sys.argv[1], sys.argv[2], sys.argv[3]
if weights == "adapter":
    from peft import AutoPeftModelForCausalLM
    model = AutoPeftModelForCausalLM.from_pretrained(directory)
elif weights == "full":
    model = AutoModelForCausalLM.from_pretrained(directory)
else:
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(weights), directory)
model.eval()
rows = []
with torch.no_grad():
    for case in json.load(open(cases_file)):
        scores = []
        for candidate in case["candidates"]:
            ids = torch.tensor([case["prompt"] + candidate])
            logprobs = model(ids).logits[0, :-1].log_softmax(-1)
            start = len(case["prompt"]) - 1
            picked = logprobs[start:start + len(candidate)].gather(
                -1, torch.tensor(candidate)[:, None])
            scores.append(picked.mean().item())
        rows.append(scores)
assert not any(name.split(".")[0] == "llamagym" for name in sys.modules)
print(json.dumps(rows))
"""


def blackjack_states(count: int) -> list[tuple[int, int, bool]]:
    states = [(total, dealer, ace) for ace in (False, True) for total in range(4, 22)
              for dealer in range(1, 11) if not (ace and total < 12)]
    return states[:count]


def scores_without_llamagym(
    agent, export: Path, weights: str, tmp_path: Path, env: dict | None = None,
    states: int = 200,
) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """Blackjack's candidate scores from the export loaded by transformers (and peft)
    alone in a fresh process (``weights`` as PLAIN_TRANSFORMERS reads it), checked equal
    to ``agent``'s: (plain, ours, prompts, candidates)."""
    engine = agent.engine
    slots = [engine.new_slot(state, {}, None, None) for state in blackjack_states(states)]
    expected = [turn.action_index for turn in engine.decide(slots, greedy=True)]
    prompts = engine.render_prompts(slots)[1]
    cases = [
        {"prompt": list(prompt), "candidates": [engine.candidate_tokens(a) for a in
                                                 agent.legal_actions(slot.observation, {})]}
        for prompt, slot in zip(prompts, slots, strict=True)
    ]
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    completed = subprocess.run(
        [sys.executable, "-c", PLAIN_TRANSFORMERS, str(export), str(cases_file), weights],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    plain = torch.tensor(json.loads(completed.stdout))
    candidates = [c["candidates"] for c in cases]
    with torch.no_grad():
        ours, _ = agent.policy.score(prompts, candidates)
    # The same numbers, not only the same choices (a policy that always sticks would
    # match any model that prefers "stick").
    assert torch.allclose(plain, ours.cpu(), atol=1e-4), (plain - ours).abs().max()
    assert plain.argmax(-1).tolist() == expected
    return plain, ours, prompts, candidates


def model_above_the_lora_threshold(directory: Path) -> Path:
    """A locally built Llama of 51M parameters (random weights, the tiny tokenizer):
    large enough that the loader gives it a LoRA adapter by itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llamagym.models.lora_choice import LORA_AUTO_THRESHOLD

    _, tokenizer = load_model_and_tokenizer("tiny")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=768, intermediate_size=2048,
        num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) > LORA_AUTO_THRESHOLD
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow  # a whole run in fresh processes: `make test` runs it, `make test-fast` does not
@pytest.mark.parametrize("weights", ["merged", "adapter"])
def test_an_export_loads_without_llamagym_and_acts_the_same(weights, tmp_path, cli) -> None:
    run_dir, export = tmp_path / "run", tmp_path / "export"
    model = ["--threads", "2"]
    if weights == "adapter":  # the loader's own rule puts LoRA on it: nothing forced
        model += ["--model", str(model_above_the_lora_threshold(tmp_path / "model51m"))]
    assert cli("run", "blackjack", *FAST, *model, "-o", run_dir)[0] == 0
    merge = ["--merge"] if weights == "merged" else []
    code, out, err = cli("export", run_dir, "--to", export, *merge)
    assert code == 0, err
    # tiny is fine-tuned whole: --merge has no adapter to merge, and says so.
    assert ("nothing to merge" in err) == (weights == "merged")
    files = {p.name for p in export.iterdir()}
    assert {"tokenizer.json", "generation_config.json", "value_head.safetensors",
            "README.md", "llamagym.json"} <= files
    assert ("adapter_config.json" in files) == (weights == "adapter")
    card = (export / "README.md").read_text()
    assert "| this model |" in card and "| basic-strategy |" in card
    assert "| policy | mean return | 95% CI | win / draw / loss |" in card
    if weights == "merged":  # the model as the run named it, not a cache path
        assert "\n# blackjack: ppo on tiny\n" in card

    agent = load_agent(run_dir)
    _, ours, prompts, candidates = scores_without_llamagym(
        agent, export, "adapter" if weights == "adapter" else "full", tmp_path
    )
    # The one loader reads a checkpoint and the export too; all three act alike.
    newest = sorted((run_dir / "checkpoints").glob("update-*"))[-1]
    exported = load_agent(export)
    for other in (load_agent(newest), exported):
        with torch.no_grad():
            again, _ = other.policy.score(prompts, candidates)
        assert torch.allclose(again, ours, atol=1e-5)
    assert torch.equal(
        exported.policy.value_head.weight, agent.policy.value_head.weight
    )



@pytest.mark.real_model
def test_a_smollm2_export_loads_offline_as_its_card_says(smollm2_dir, tmp_path, cli) -> None:
    """SmolLM2 came from PyPI's GGUF, not the Hub: the card's offline lines (the base
    directory `llamagym models fetch` prints, the adapter put on it) load it with
    transformers and peft alone, the Hub switched off, and it scores as the agent does."""
    run_dir, export = tmp_path / "run", tmp_path / "export"
    assert cli(
        "run", "blackjack", "--model", "smollm2-135m", "-n", "8", "--num-envs", "8",
        "--eval-episodes", "4", "--threads", "2", "--quiet", "-o", run_dir,
        "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    )[0] == 0
    code, _, err = cli("export", run_dir, "--to", export)
    assert code == 0, err
    card = (export / "README.md").read_text()
    assert "AutoPeftModelForCausalLM.from_pretrained(\"THIS_DIR\")" in card
    fetch = re.search(r"`(llamagym models fetch [\w.-]+)`", card)
    assert fetch is not None, card
    code, out, err = cli(*fetch.group(1).split()[1:])
    assert code == 0, err
    base = Path(out.strip().splitlines()[-1])
    assert base.resolve() == Path(smollm2_dir).resolve()
    assert 'PeftModel.from_pretrained(base, "THIS_DIR")' in card
    # Exactly as transformers scores it: the trunk in float32, as the export holds it
    # (a run's bfloat16 trunk would be within its precision, not within 1e-4).
    scores_without_llamagym(
        load_agent(export, overrides={"model": {"trunk_dtype": "float32"}}), export,
        str(base), tmp_path,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, states=24,
    )


def test_export_refuses_a_directory_that_holds_something(tmp_path, cli) -> None:
    run_dir, export = tmp_path / "run", tmp_path / "export"
    assert cli("run", "blackjack", *FAST, "-o", run_dir)[0] == 0
    export.mkdir()
    (export / "keep.txt").write_text("mine")
    code, _, err = cli("export", run_dir, "--to", export)
    assert code == 2 and "is not empty" in err and "--overwrite" in err
    assert [p.name for p in export.iterdir()] == ["keep.txt"]


# -- where an export goes --------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A finished one-update Blackjack run of the tiny model with a LoRA adapter: its
    export is an adapter, or with --merge a whole model."""
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.testing import tiny_agent
    from llamagym.training.loop.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    agent = tiny_agent(
        BlackjackAgent,
        model={"lora": True},
        rollout={"num_envs": 4},
        algorithm={"episodes_per_update": 8, "minibatch_size": 8, "epochs": 1},
        training={"episodes": 8, "threads": 1, "eval_episodes": 0},
        output={"dir": str(run_dir), "quiet": True, "report": False},
    )
    Trainer(agent, agent.session).run()
    return run_dir


@pytest.mark.parametrize("where", ["a file", "under a file", "dangling link", "link loop"])
def test_an_export_target_that_cannot_be_a_directory_is_one_line(
    where: str, lora_run: Path, tmp_path: Path, cli
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    target = {
        "a file": notes,
        "under a file": notes / "export",
        "dangling link": tmp_path / "gone",
        "link loop": tmp_path / "loop",
    }[where]
    if where == "dangling link":
        target.symlink_to(tmp_path / "nowhere")
    if where == "link loop":
        target.symlink_to(target)
    code, out, err = cli("export", lora_run, "--to", target, "--overwrite")
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert repr(str(target)) in line
    says = {
        "a file": "is a file, not a directory",
        "under a file": f"lies under {str(notes)!r}, which is not a directory",
        "dangling link": f"a symbolic link to {str(tmp_path / 'nowhere')!r}, which does not",
        "link loop": "is a symbolic link that leads back to itself",
    }[where]
    assert says in line
    assert notes.read_text() == "mine"
    links = {"dangling link": ["gone"], "link loop": ["loop"]}.get(where, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["notes.txt", *links])


def export_files(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


def test_overwrite_replaces_one_kind_of_export_with_the_other(
    lora_run: Path, tmp_path: Path, cli
) -> None:
    export = tmp_path / "export"
    assert cli("export", lora_run, "--to", export, "--merge")[0] == 0
    assert {"config.json", "model.safetensors"} <= export_files(export)
    (export / "notes.txt").write_text("mine")
    checkpoint_agent = load_agent(lora_run)
    prompts = [[1, 2, 3, 4]]
    candidates = [[[5], [6, 7]]]
    with torch.no_grad():
        expected, _ = checkpoint_agent.policy.score(prompts, candidates)

    code, _, err = cli("export", lora_run, "--to", export, "--overwrite")
    assert code == 0, err
    files = export_files(export)
    assert {"adapter_config.json", "adapter_model.safetensors", "notes.txt"} <= files
    assert not files & {"config.json", "model.safetensors"}, "no whole model beside the adapter"
    assert not any(name.startswith(".") for name in files), "no staging left"
    assert json.loads((export / "llamagym.json").read_text())["weights"] == "adapter"
    adapter = load_agent(export)
    assert hasattr(adapter.policy.model, "peft_config")
    with torch.no_grad():
        assert torch.allclose(adapter.policy.score(prompts, candidates)[0], expected, atol=1e-5)

    code, _, err = cli("export", lora_run, "--to", export, "--merge", "--overwrite")
    assert code == 0, err
    files = export_files(export)
    assert {"config.json", "model.safetensors", "notes.txt"} <= files
    assert not files & {"adapter_config.json", "adapter_model.safetensors"}, "no adapter left"
    assert (export / "notes.txt").read_text() == "mine"
    merged = load_agent(export)
    assert not hasattr(merged.policy.model, "peft_config")
    with torch.no_grad():
        assert torch.allclose(merged.policy.score(prompts, candidates)[0], expected, atol=1e-5)


def test_an_export_that_fills_the_disk_leaves_the_old_one(
    lora_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli
) -> None:
    import errno

    export = tmp_path / "export"
    assert cli("export", lora_run, "--to", export, "--merge")[0] == 0
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    real_write_text = Path.write_text

    def write_text(self: Path, *args, **kwargs):
        if self.name == "README.md":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    code, _, err = cli("export", lora_run, "--to", export, "--overwrite")
    assert code == 2
    line = one_error_line(err)
    assert f"could not export into {str(export)!r}: the disk is full" in line
    assert "free space on that disk, then export again" in line
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], "no staging left"
