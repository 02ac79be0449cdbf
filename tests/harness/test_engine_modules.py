"""Engine modules are named after their engines: ``suite/engines/<name>.py`` (``-`` → ``_``), or the module of the
engine a variant extends (``torch-cuda`` in ``torch``, ``vllm-triton-colmajor`` in ``vllm_triton``)."""

from __future__ import annotations

from fp8rl.registry import BUILTINS


def test_every_builtin_engine_lives_in_the_module_named_after_it_exact():
    bad = []
    for name, spec in BUILTINS.items():
        module = spec.split(":")[0].removeprefix("fp8rl.engines.")
        base = name.replace("-", "_")
        if not (base == module or base.startswith(module + "_")):
            bad.append(f"{name}: {spec}")
    assert not bad, f"engines whose module is not named after them: {bad}"
