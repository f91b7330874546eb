"""LlamaGym's TextWorldExpress plugin: one agent per TextWorldExpress game (``twx-coin``, ...)."""
