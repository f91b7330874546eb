"""One process of the FSDP2 test (tests/trl_backend/test_sharded.py), started by torchrun with two
processes over gloo: the tiny model sharded by accelerate's own FSDP2 preparation, the
TRL backend's rollout function playing a different number of episodes in each process,
a training step on the sharded model, and the end of a run (gathered weights, the main
process's evaluation and export). Prints one ``RESULT {json}`` line per process.

accelerate turns FSDP on only on GPUs; this process switches its accelerator's state to
FSDP2 after creating it, so that accelerate's FSDP2 code (``prepare``, ``get_state_dict``)
runs on the CPU as it would on GPUs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from llamagym_blackjack.agent import BlackjackAgent

from llamagym.models.loading import load_model_and_tokenizer
from llamagym.models.policy import Policy
from llamagym.resolver.layers import resolve_agent_config
from llamagym.rollout.evaluation import evaluate_agent
from llamagym.training.records.export import export_agent
from llamagym.trl_backend.rollout import EpisodeRollouts
from llamagym.trl_backend.sharded import full_state_dict, whole_model


def digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        sha.update(name.encode())
        # A copy: numpy would pin the unsharded storage, which FSDP2 frees on resharding.
        sha.update(parameter.detach().float().clone().numpy().tobytes())
    return sha.hexdigest()


def main(output: Path) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True
    )
    rank = dist.get_rank()
    model, tokenizer = load_model_and_tokenizer("tiny", device="cpu", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    state.distributed_type = DistributedType.FSDP  # prepare reads the launch's type back
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(sharded) > 1, "accelerate did not shard the model's layers"
    layer = {
        "rollout": {"mode": "generate", "num_envs": 4},
        "training": {"threads": 1},
        "output": {"quiet": True, "dir": str(output / f"run-{rank}")},
    }
    agent = BlackjackAgent(config=resolve_agent_config(BlackjackAgent, [("--set", layer)]))
    trainer = SimpleNamespace(
        accelerator=accelerator,
        model_wrapped=model,
        model=model,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        use_vllm=False,
    )
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    # 1. The rollout: rank 0 plays 2 episodes, rank 1 twelve, in two calls each.
    rollouts = EpisodeRollouts(agent, tokenizer, seed=rank)
    played = 0
    for _call in range(2):
        prompts = [f"seed={100 * rank + k}" for k in range(1 if rank == 0 else 6)]
        played += len(rollouts(prompts, trainer)["completion_ids"])
    rollouts.close()
    passes = forwards[0]
    counts = [None, None]
    dist.all_gather_object(counts, passes)

    # 2. The model trains sharded afterwards: one step on each process's own tokens.
    before = full_state_dict(trainer)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]]) + rank
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

    # 3. The end of a run: weights gathered by every process, then the main process alone
    # plays and exports inside whole_model while the other has left it.
    weights = full_state_dict(trainer)
    with whole_model(trainer) as trained:
        digests = [None, None]
        dist.all_gather_object(digests, digest(trained))
        result = {
            "rank": rank,
            "played": played,
            "forward_passes": counts,
            "whole_digests": digests,
        }
        if rank == 0:
            assert weights is not None and before is not None
            changed = any(not torch.equal(weights[k], before[k]) for k in weights)
            agent.use_policy(Policy(trained, tokenizer))
            alone = evaluate_agent(agent.evaluation_engine(), episodes=6, greedy=True)
            export = export_agent(
                agent, agent.policy, output / "model", training={"updates": 1}, weights=weights
            )
            result.update(
                weights_changed=changed,
                evaluated=alone.episodes,
                export=str(export),
                gathered_digest=hashlib.sha256(
                    b"".join(
                        k.encode() + weights[k].float().contiguous().numpy().tobytes()
                        for k in sorted(weights)
                    )
                ).hexdigest(),
            )
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
