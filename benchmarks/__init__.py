"""The benchmark suites: ``python -m benchmarks.<suite>`` from the repository root (benchmarks/README.md
has the table of suites, what each measures and its command). Each suite prints its table last and
writes its headline figures into docs/results/headline.json itself (``benchmarks/headline.py``)."""
