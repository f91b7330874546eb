"""What the frozen trunk (the 26 layers of SmolLM2-135M below LoRA's 4) could run on, per
CPU: speed of the bare trunk and how far each engine moves the policy's decisions, in one
process, against float32 measured beside it.

    python benchmarks/trunk_engines.py            # every engine, 8 x 128 tokens, 5 repeats
    python benchmarks/trunk_engines.py --quick    # 2 repeats, fewer decisions: a smoke run

Engines (each applied to a fresh copy of the loaded model's trunk layers):

* ``float32``: the layers as loaded (what ``model.trunk_dtype: auto`` keeps without
  ``avx512_bf16``); ``bfloat16``: the shipped lowering (``lower_trunk_precision``);
* ``inductor``: each trunk layer under ``torch.compile`` (inductor's CPU backend);
* ``int8 fbgemm, per tensor`` / ``per channel``: torch's dynamic int8 linear layers
  (int8 weights, each input quantized with one scale per tensor);
* ``w8a8 smoothed``: int8 weights per output channel and int8 inputs per token, after
  SmoothQuant's scaling (alpha 0.5, the inputs' ranges taken from other text than the
  decisions measured), through oneDNN's int8 matrix product; ``down_proj float32`` keeps
  the MLP's last projection in float32, its inputs having the widest range;
  ``int8 fbgemm, per channel, smoothed``: torch's dynamic int8 layers on the smoothed
  weights (one scale per input tensor, the inputs divided by SmoothQuant's factors);
* ``torchao ...``: torchao's int8 configs, where torchao is installed.

Speed: tokens per second of the trunk's forward over 8 rows of 128 tokens (the decoder
with its top layers taken out), median of the repeats. Decisions: score-mode decisions of
Blackjack, CartPole and TextWorld played by the float32 policy, sampled; each engine's
action log-probabilities against float32's (mean and largest gap in nats, and the share
of decisions whose greedy action agrees, among those whose two best actions are further
apart than twice the largest gap).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

from benchmarks.common import (  # noqa: E402
    add_allow_dirty,
    cpu_flags,
    peak_rss_mb,
    refuse_dirty_tree,
    write_script_result,
)

TRUNK_START = 26  # SmolLM2-135M: 30 decoder layers, LoRA on the last 4 (the registry's)
SMOOTH_ALPHA = 0.5


# -- engines -------------------------------------------------------------------------
def _trunk_linears(layers: Any, skip: tuple[str, ...] = ()) -> list[tuple[Any, str, Any]]:
    """(parent module, attribute, nn.Linear) of every linear layer in the trunk."""
    from torch import nn

    found = []
    for layer in layers[:TRUNK_START]:
        for module in layer.modules():
            for name, child in module.named_children():
                if isinstance(child, nn.Linear) and name not in skip:
                    found.append((module, name, child))
    return found


def _fbgemm(per_channel: bool) -> Callable[[Any, Any], None]:
    def apply(layers: Any, _calibration: Any) -> None:
        import warnings

        from torch import nn
        from torch.ao.quantization import (
            default_dynamic_qconfig,
            per_channel_dynamic_qconfig,
            quantize_dynamic,
        )

        qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for parent, name, linear in _trunk_linears(layers):
                quantized = quantize_dynamic(nn.Sequential(linear), {nn.Linear: qconfig})
                setattr(parent, name, quantized[0])

    return apply


class SmoothedInt8Linear:
    """y = x W^T + b with W in int8 per output channel and x in int8 per token (its own
    scale per row), x first divided by SmoothQuant's per-input-channel factors (folded
    into W). The int8 product is oneDNN's: with an input scale of 1 it returns
    sum(x_q * w_q) * w_scale in float32, and each row is then multiplied by its scale."""

    def __init__(self, linear: Any, input_range: Any) -> None:
        import torch

        factor = smoothing_factor(linear, input_range)
        weight = linear.weight.detach().float() * factor[None, :]
        self.inverse = 1.0 / factor
        self.weight_scale = weight.abs().amax(1).clamp(min=1e-8) / 127
        quantized = torch.round(weight / self.weight_scale[:, None]).to(torch.int8)
        self.packed = torch.ops.onednn.qlinear_prepack(quantized, None)
        self.zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.out_features = weight.shape[0]

    def __call__(self, x: Any) -> Any:
        import torch

        shape = x.shape
        rows = (x.reshape(-1, shape[-1]) * self.inverse).contiguous()
        scale = rows.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        unsigned = (torch.round(rows / scale) + 128).to(torch.uint8)
        out = torch.ops.onednn.qlinear_pointwise(
            unsigned, 1.0, 128, self.packed, self.weight_scale, self.zeros, self.bias,
            1.0, 0, torch.float32, "none", [], "")
        return (out * scale).reshape(*shape[:-1], self.out_features)


def smoothing_factor(linear: Any, input_range: Any) -> Any:
    """SmoothQuant's per-input-channel factor: the inputs are divided by it and the
    weights' columns multiplied by it, moving the inputs' outliers into the weights."""
    weight = linear.weight.detach().float()
    return (input_range.clamp(min=1e-5) ** SMOOTH_ALPHA
            / weight.abs().amax(0).clamp(min=1e-5) ** (1 - SMOOTH_ALPHA)).clamp(min=1e-5)


class SmoothedDynamicLinear:
    """fbgemm's dynamic int8 linear layer (one scale per input tensor) on SmoothQuant's
    smoothed weights, its input divided by the factors first."""

    def __init__(self, linear: Any, input_range: Any) -> None:
        import warnings

        import torch
        from torch import nn
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        factor = smoothing_factor(linear, input_range)
        self.inverse = 1.0 / factor
        smoothed = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None)
        with torch.no_grad():
            smoothed.weight.copy_(linear.weight.detach().float() * factor[None, :])
            if linear.bias is not None:
                smoothed.bias.copy_(linear.bias.detach().float())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.quantized = quantize_dynamic(
                nn.Sequential(smoothed), {nn.Linear: per_channel_dynamic_qconfig})[0]

    def __call__(self, x: Any) -> Any:
        return self.quantized(x * self.inverse)


def _smoothed(skip: tuple[str, ...], engine: type | None = None) -> Callable[[Any, Any], None]:
    def apply(layers: Any, calibration: Any) -> None:
        import torch
        from torch import nn

        targets = _trunk_linears(layers, skip)
        ranges: dict[int, torch.Tensor] = {}
        hooks = []
        for index, (_, _, linear) in enumerate(targets):
            def keep(_module: Any, args: tuple, index: int = index) -> None:
                seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
                ranges[index] = torch.maximum(ranges[index], seen) if index in ranges else seen
            hooks.append(linear.register_forward_pre_hook(keep))
        calibration()
        for hook in hooks:
            hook.remove()

        class Wrapped(nn.Module):
            def __init__(self, engine: SmoothedInt8Linear) -> None:
                super().__init__()
                self.engine = engine

            def forward(self, x: Any) -> Any:
                return self.engine(x)

        for index, (parent, name, linear) in enumerate(targets):
            setattr(parent, name, Wrapped((engine or SmoothedInt8Linear)(linear, ranges[index])))

    return apply


def _inductor(layers: Any, _calibration: Any) -> None:
    import torch

    for layer in layers[:TRUNK_START]:
        layer.forward = torch.compile(layer.forward, dynamic=True)


def _torchao(config_name: str, compiled: bool) -> Callable[[Any, Any], None]:
    def apply(layers: Any, calibration: Any) -> None:
        import torchao.quantization as quantization

        config = getattr(quantization, config_name)()
        for layer in layers[:TRUNK_START]:
            quantization.quantize_(layer, config)
        if compiled:
            _inductor(layers, calibration)

    return apply


ENGINES: dict[str, Callable[[Any, Any], None] | None] = {
    "float32": None,
    "bfloat16": None,  # the shipped lowering, applied through lower_trunk_precision
    "inductor": _inductor,
    "int8 fbgemm, per tensor": _fbgemm(per_channel=False),
    "int8 fbgemm, per channel": _fbgemm(per_channel=True),
    "w8a8 smoothed": _smoothed(()),
    "w8a8 smoothed, down_proj float32": _smoothed(("down_proj",)),
    "int8 fbgemm, per channel, smoothed": _smoothed((), SmoothedDynamicLinear),
    "torchao int8 weight-only": _torchao("Int8WeightOnlyConfig", compiled=False),
    "torchao int8 dynamic": _torchao("Int8DynamicActivationInt8WeightConfig", compiled=False),
    "torchao int8 dynamic, inductor": _torchao("Int8DynamicActivationInt8WeightConfig",
                                               compiled=True),
}


# -- measurements --------------------------------------------------------------------
def trunk_speed(policy: Any, ids: Any, repeats: int) -> float:
    """Median tokens/s of the trunk's forward over ``ids`` (the top layers taken out)."""
    import torch
    from torch import nn

    from llamagym.models.decoder import decoder_and_head

    decoder = decoder_and_head(policy.model)[0]
    layers = decoder.layers
    decoder.layers = nn.ModuleList(list(layers)[:TRUNK_START])
    rates = []
    try:
        with torch.no_grad():
            decoder(input_ids=ids[:2])
            decoder(input_ids=ids)  # warm-up (and the compile, for inductor)
            for _ in range(repeats):
                started = time.perf_counter()
                decoder(input_ids=ids)
                rates.append(ids.numel() / (time.perf_counter() - started))
    finally:
        decoder.layers = layers
    return statistics.median(rates)


def decisions(name: str, model: str, count: int) -> Any:
    """An agent of ``name`` on the float32 trunk and ``count`` sampled decisions of it."""
    from llamagym_blackjack.agent import BlackjackAgent
    from llamagym_cartpole.agent import CartPoleAgent
    from llamagym_textworld.agent import TextWorldAgent

    agent_class = {"blackjack": BlackjackAgent, "cartpole": CartPoleAgent,
                   "textworld": TextWorldAgent}[name]
    config: dict[str, Any] = {
        "model": {"name": model, "lora_layers": 4, "trunk_dtype": "float32"},
        "output": {"dir": None},
        "rollout": {"mode": "score", "num_envs": 4},
        "training": {"threads": 2, "seed": 0},
    }
    if name == "textworld":
        config["agent"] = {"games": 4, "max_episode_steps": 8}
    if name == "cartpole":
        config["rollout"]["max_episode_turns"] = 8
    agent = agent_class(config=config)
    turns: list[Any] = []
    while len(turns) < count:
        episodes = agent.engine.play(24 if name == "blackjack" else 4)
        turns += [turn for episode in episodes for turn in episode.turns]
    return agent, turns[:count]


def action_log_probs(policy: Any, turns: list[Any]) -> Any:
    import torch

    if policy.trunk is not None:
        policy.trunk.clear()
        policy.trunk.disabled = True  # every pass whole, through the engine
    with torch.no_grad():
        scores, _ = policy.score([t.prompt_tokens for t in turns], [t.candidates for t in turns])
    return policy.action_log_probs(scores)


def compare(exact: Any, other: Any) -> dict[str, Any]:
    import torch

    real = torch.isfinite(exact)
    if not torch.equal(real, torch.isfinite(other)):
        return {"error": "an engine gave a non-finite log-probability where float32 did not"}
    gaps = (exact[real] - other[real]).abs()
    largest = gaps.max().item()
    top2 = exact.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * largest
    agree = exact.argmax(-1) == other.argmax(-1)
    return {
        "mean_gap_nats": gaps.mean().item(),
        "largest_gap_nats": largest,
        "greedy_agrees": agree.float().mean().item(),
        "clear_decisions": int(clear.sum()),
        "greedy_agrees_where_clear": agree[clear].float().mean().item() if clear.any() else None,
    }


def engine_copy(source: Any, engine: str, calibrate_ids: Any) -> Any:
    """A deep copy of ``source`` (a Policy) with its trunk on ``engine``."""
    import torch

    from llamagym.models.decoder import decoder_and_head
    from llamagym.models.trunk_precision import lower_trunk_precision

    policy = copy.deepcopy(source)
    if engine == "bfloat16":
        lower_trunk_precision(policy.model, "bfloat16", torch.device("cpu"))
        return policy
    apply = ENGINES[engine]
    if apply is not None:
        decoder = decoder_and_head(policy.model)[0]

        def calibration() -> None:
            with torch.no_grad():
                decoder(input_ids=calibrate_ids)

        apply(decoder.layers, calibration)
    return policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, 8 decisions per env.")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engines", nargs="*", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    add_allow_dirty(parser)
    args = parser.parse_args()
    refuse_dirty_tree("trunk-engines", args.quick, args.allow_dirty)
    import torch

    torch.set_num_threads(2)
    repeats, count = (2, 8) if args.quick else (5, 32)
    played = {name: decisions(name, args.model, count)
              for name in ("blackjack", "cartpole", "textworld")}
    base = played["textworld"][0].policy
    tokenizer = base.tokenizer
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    tokens = tokenizer(text, return_tensors="pt").input_ids[0]
    calibrate_ids, ids = tokens[: 8 * 128].view(8, 128), tokens[8 * 128: 16 * 128].view(8, 128)
    exact = {name: action_log_probs(agent.policy, turns) for name, (agent, turns) in played.items()}
    float32_before = trunk_speed(base, ids, repeats)
    print(f"float32: {float32_before:.0f} tokens/s", flush=True)
    result: dict[str, Any] = {"model": args.model, "trunk_layers": TRUNK_START,
                              "tokens": list(ids.shape), "repeats": repeats,
                              "cpu_flags": cpu_flags(), "engines": {}}
    for engine in args.engines:
        if engine == "float32":
            continue
        try:
            rows: dict[str, Any] = {}
            for name, (agent, turns) in played.items():
                copied = engine_copy(agent.policy, engine, calibrate_ids)
                rows[name] = compare(exact[name], action_log_probs(copied, turns))
                if name == "textworld":
                    rows["tokens_per_second"] = trunk_speed(copied, ids, repeats)
                del copied
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is a result
            rows = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        result["engines"][engine] = rows
        speed = rows.get("tokens_per_second")
        gaps = [rows[n].get("mean_gap_nats") for n in played if isinstance(rows.get(n), dict)]
        print(f"{engine}: " + (f"{speed:.0f} tokens/s ({speed / float32_before:.2f}x), "
                               f"mean gaps {', '.join(f'{g:.3f}' for g in gaps if g is not None)}"
                               if speed else rows.get("error", "")), flush=True)
    float32_after = trunk_speed(base, ids, repeats)
    result["float32_tokens_per_second"] = {"before": float32_before, "after": float32_after}
    reference = statistics.mean([float32_before, float32_after])
    for rows in result["engines"].values():
        if "tokens_per_second" in rows:
            rows["speedup"] = rows["tokens_per_second"] / reference
    result["peak_rss_mb"] = peak_rss_mb()
    path = write_script_result("trunk-engines", args.quick, args.output, result)
    print(f"float32 {float32_before:.0f} / {float32_after:.0f} tokens/s (before / after) -> {path}")


if __name__ == "__main__":
    main()
