"""LlamaGym plugin __DISTRIBUTION__: __WHAT__."""

__version__ = "0.1.0"
