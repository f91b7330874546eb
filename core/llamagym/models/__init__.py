"""The language model side: loading (Hub ids, local directories, GGUF files,
the offline `tiny` model), the model registry, and the policy (LM + value
head) that scores and generates."""

from typing import TYPE_CHECKING

from llamagym import moved_name as _moved_name

if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
