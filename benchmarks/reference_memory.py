"""The KL reference policy costs no second copy of the model.

Builds a ~5M-parameter Llama locally, puts a LoRA adapter on it and, in two fresh
processes, computes reference log-probabilities for the same batch either with the
adapter switched off (LlamaGym's way) or with a separate frozen copy of the model.
Prints and writes JSON: parameter counts and peak RSS of each process, to
``benchmarks/results/reference_memory.json`` (``reference_memory-quick.json`` with
``--quick``).

    python -m benchmarks.reference_memory [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_allow_dirty,
    refuse_dirty_tree,
    write_script_result,
)


def measure(mode: str, hidden: int, layers: int) -> dict:
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from llamagym.models.loading import load_model_and_tokenizer

    torch.manual_seed(0)
    _, tokenizer = load_model_and_tokenizer("tiny")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    base = LlamaForCausalLM(config)
    base_parameters = sum(p.numel() for p in base.parameters())
    model = get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    batch = torch.randint(5, len(tokenizer), (16, 80))
    copied_parameters = 0
    with torch.no_grad():
        if mode == "copy":
            # What a trainer without adapter switching keeps: a frozen duplicate.
            reference_model = copy.deepcopy(model.get_base_model()).eval()
            copied_parameters = sum(p.numel() for p in reference_model.parameters())
            with model.disable_adapter():  # the copy must hold the adapter-free weights
                reference = reference_model(input_ids=batch).logits.log_softmax(-1).sum()
        else:
            # LlamaGym's reference: the same weights with the LoRA adapter switched off.
            with model.disable_adapter():
                reference = model(input_ids=batch).logits.log_softmax(-1).sum()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "mode": mode,
        "base_parameters": base_parameters,
        "trainable_parameters": trainable,
        "reference_copy_parameters": copied_parameters,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "checksum": float(reference),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", choices=["adapter-off", "copy"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    add_allow_dirty(parser)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.hidden, args.layers)))
        return
    refuse_dirty_tree("reference_memory", args.quick, args.allow_dirty)
    hidden, layers = (128, 2) if args.quick else (args.hidden, args.layers)
    rows = []
    for mode in ("adapter-off", "copy"):
        command = [sys.executable, "-m", "benchmarks.reference_memory", "--child", mode]
        command += ["--hidden", str(hidden), "--layers", str(layers)]
        out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {
        "hidden_size": hidden,
        "layers": layers,
        "rows": rows,
        "extra_parameters_for_a_copy": rows[1]["reference_copy_parameters"],
        "peak_rss_ratio_copy_over_adapter_off": rows[1]["peak_rss_mb"] / rows[0]["peak_rss_mb"],
    }
    path = write_script_result("reference_memory", args.quick, None, result)
    print(json.dumps(result, indent=2))
    print(f"written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
