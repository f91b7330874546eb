"""LlamaGym plugin llamagym-steps03: a REINFORCE-style training algorithm."""

__version__ = "0.1.0"
