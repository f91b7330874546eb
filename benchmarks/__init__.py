"""LlamaGym's benchmark harness: ``python -m benchmarks all [--quick]``.

Not part of the installed distribution and not run by the test suite (apart from one
``--quick`` smoke test). See ``benchmarks/README.md`` for what each part measures and
the fields of the JSON files it writes to ``benchmarks/results/``.
"""
