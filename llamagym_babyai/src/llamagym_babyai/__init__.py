"""LlamaGym's BabyAI plugin: agent ``babyai`` on MiniGrid's BabyAI levels, in words."""
