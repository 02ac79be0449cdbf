"""asv benchmarks of fp8rl (see perf/README.md). Importable with any installed fp8rl: optional APIs are probed
in ``setup`` and a missing one raises NotImplementedError, which asv records as a skipped benchmark."""
