"""fp8rl.perf: analytic roofline/KV-capacity model, rollout throughput harness, claim and regression gates,
benchmarks (see perf/README.md). Submodules import lazily; nothing here needs a GPU."""
