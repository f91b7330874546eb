"""The language model side: loading (Hub ids, local directories, GGUF files,
the offline `tiny` model), the model registry, and the policy (LM + value
head) that scores and generates."""


def __getattr__(name: str) -> object:
    from llamagym import moved_name

    return moved_name(__name__, name)
