"""The language model side: loading (Hub ids, local directories, GGUF files,
the offline `tiny` model), the model registry, and the policy (LM + value
head) that scores and generates."""

from llamagym import moved_name as _moved_name


def __getattr__(name: str) -> object:
    return _moved_name(__name__, name)
