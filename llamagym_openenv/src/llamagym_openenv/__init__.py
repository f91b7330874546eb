"""LlamaGym over OpenEnv: ``llamagym serve AGENT`` and agent ``openenv``."""
