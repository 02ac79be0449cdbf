"""``python -m fp8rl.engines.vllm``: evidence script for the vLLM-only configurations (needs vllm)."""

from __future__ import annotations

from . import VllmEngine, kv_scales_in_use


def _main() -> None:  # pragma: no cover - evidence script for the vLLM-only configurations (needs vllm)
    """Mismatch of the vLLM-only configurations vs the BF16 trainer, and the KV scales vLLM runs with."""
    import os

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a callable
    from fp8rl.conformance import _e2e as E

    eng = VllmEngine()
    for recipe in ("fp8-kv", "vllm-fp8-e5m2-kv", "fp8-linear-ptpc"):
        res = E.measure(eng, "tiny-qwen3", recipe)
        print(E.fmt_case(res))
    from fp8rl import fixtures

    m = fixtures.tiny_model("tiny-qwen3")
    h = eng.rollout_init(m.config, m.state_dict, "fp8-kv")
    print("fp8-kv k/v scales in use:", kv_scales_in_use(h))


if __name__ == "__main__":
    _main()
