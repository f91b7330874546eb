"""LlamaGym's TextWorld plugin: agent ``textworld`` on locally generated TextWorld games."""
