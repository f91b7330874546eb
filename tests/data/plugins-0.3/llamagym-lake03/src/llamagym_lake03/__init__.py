"""LlamaGym plugin llamagym-lake03: an LLM agent for Gymnasium's FrozenLake-v1."""

__version__ = "0.1.0"
