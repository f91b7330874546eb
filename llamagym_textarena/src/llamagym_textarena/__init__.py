"""LlamaGym agents for TextArena single-player games."""
