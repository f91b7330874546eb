"""Checkpoints: writing, finding and reading them (``store``), the training state as JSON
and named tensors (``state``), tensors checked before they are copied (``tensors``), the
model a checkpoint names (``trust``) and their errors (``errors``). Above the run
records, whose readers they use; below the loop.

In 0.3 this package was one module, ``llamagym.training.checkpoint``; a name taken from
it fails with one line naming the module that holds it now."""

from typing import TYPE_CHECKING

from llamagym import moved_name as _moved_name

if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
