"""The whole model in every process while episodes play, for a model that accelerate
shards (DeepSpeed ZeRO-3, FSDP): what the TRL backend's rollout and its end of run need.

A sharded model gathers each layer's parameters from the other processes inside every
forward pass, so every process must run the same number of passes. A multi-turn rollout
cannot promise that: episodes end after different numbers of turns, replies end at
different lengths, and one process may play more turns than another. TRL's own rollout
makes one ``generate`` call per process, which transformers keeps in step across ranks
(``synced_gpus``); an episode of several turns makes as many calls as it has turns.

So the parameters are gathered once, before the episodes play, and the passes in between
run on whole parameters with no collective in them:

* ZeRO-3: TRL's :func:`trl.models.unwrap_model_for_generation` with its parameters
  gathered (``deepspeed.zero.GatheredParameters``, the forward hooks removed); the
  setting that turns that gathering off (``trl.ds3_gather_for_generation=false``) is
  refused by the backend for this reason;
* FSDP (1): TRL's ``DistributedBackend.summon_full_params``, over every nested unit
  (TRL's own generation summons the root's only and relies on ``synced_gpus``);
* FSDP2 (``fully_shard``): every FSDP module unsharded (``FSDPModule.unshard``) with
  resharding after forward switched off, so the forward hooks find their parameters in
  place; resharded on the way out.

Entering and leaving are collective for ZeRO-3, FSDP and FSDP2 alike, so every process
enters once per rollout call (TRL calls the rollout function once per generation batch in
every process). The cost is the whole model's parameters on every device while the
episodes play: what TRL's ZeRO-3 generation pays by default.

At the end of a run the trained weights are gathered the way accelerate documents
(``Accelerator.get_state_dict``: ZeRO-3's 16-bit consolidation, FSDP's full state dict
on rank 0); the main process evaluates inside :func:`whole_model` and exports from that
state dict, since an FSDP2 module's own ``state_dict`` reshards it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule


def _fsdp2_modules(model: nn.Module) -> list[Any]:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _reshards_after_forward(module: Any) -> bool:
    # FSDP2 keeps the setting as the param group's post-forward mesh (None: keep the
    # parameters unsharded after forward); a module without parameters has no group.
    state = module._get_fsdp_state()
    group = getattr(state, "_fsdp_param_group", None)
    return group is not None and group.post_forward_mesh_info is not None


@contextlib.contextmanager
def fsdp2_unsharded(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 module of ``model`` unsharded, and kept so across forward passes,
    until the block ends (then resharded, each module's setting restored). No-op for a
    model without FSDP2 modules."""
    modules = _fsdp2_modules(model)
    if not modules:
        yield
        return
    if modules[0] is model:
        # The root's own setup otherwise waits for its first forward pass; the policy may
        # call an inner module (the decoder) first, which FSDP2 would take for the root.
        model._get_fsdp_state()._lazy_init()
    settings = [_reshards_after_forward(module) for module in modules]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module, reshard in zip(modules, settings, strict=True):
            module.reshard()
            module.set_reshard_after_forward(reshard, recurse=False)


@contextlib.contextmanager
def whole_model(trainer: Any) -> Iterator[nn.Module]:
    """The model TRL trains (``trainer.model_wrapped``) unwrapped, its parameters whole
    in this process for the block (see the module docstring). Every process must enter
    it together. Gradient checkpointing is off inside, as in TRL's generation."""
    from trl.distributed import DistributedBackend
    from trl.models import unwrap_model_for_generation

    accelerator, wrapped = trainer.accelerator, trainer.model_wrapped
    backend = DistributedBackend(accelerator)
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(
            unwrap_model_for_generation(
                wrapped,
                accelerator,
                gather_deepspeed3_params=True,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            )
        )
        if backend.fsdp_version == 1:
            stack.enter_context(
                backend.summon_full_params(wrapped, recurse=True, writeback=False)
            )
        stack.enter_context(fsdp2_unsharded(wrapped))
        yield model


def full_state_dict(trainer: Any) -> dict[str, Any] | None:
    """The trained weights as one state dict, gathered from every process (collective:
    every process calls it); None where the model is not sharded, so the model's own
    ``state_dict`` serves."""
    from trl.distributed import DistributedBackend

    backend = DistributedBackend(trainer.accelerator)
    if not (backend.is_zero3 or backend.is_fsdp):
        return None
    return trainer.accelerator.get_state_dict(trainer.model_wrapped)
