"""The vLLM adapter's cap on running ``vllm.LLM`` instances (suite/engines/vllm/llm.py): starting one beyond
``FP8RL_VLLM_MAX_LLMS`` stops the least recently used, which starts again, with the weights it last held, when a
handle uses it. Driven with a stand-in ``vllm`` module (records each start, its checkpoint and each stop), so it runs
without vLLM; the real engine's memory is measured in the vllm tier."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from fp8rl import fixtures
from fp8rl.engines import vllm as V
from fp8rl.engines.vllm import llm as L
from fp8rl.fixtures import digest_state_dict
from safetensors.torch import load_file


class _Core:
    def __init__(self, owner):
        self.owner = owner

    def shutdown(self):
        self.owner.stopped = True


class FakeLLM:
    """Stands in for ``vllm.LLM``: keeps the weights of the checkpoint it was started on."""

    started: list = []

    def __init__(self, model, **kwargs):
        import pathlib

        files = sorted(pathlib.Path(model).glob("*.safetensors"))
        self.weights = {k: v for f in files for k, v in load_file(str(f)).items()}
        self.kwargs = kwargs
        self.stopped = False
        self.llm_engine = types.SimpleNamespace(engine_core=_Core(self))
        FakeLLM.started.append(self)

    def collective_rpc(self, method, kwargs=None):
        assert not self.stopped, "an RPC reached a stopped LLM"
        if method == "reload_weights":
            import pathlib

            files = sorted(pathlib.Path(kwargs["weights_path"]).glob("*.safetensors"))
            self.weights = {k: v for f in files for k, v in load_file(str(f)).items()}
        return [None]


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, __version__="0.0-fake"))
    monkeypatch.setattr(L, "vllm_reason", lambda: None)
    monkeypatch.setattr(L, "_LLMS", L.OrderedDict())
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    FakeLLM.started = []
    yield
    for e in list(L._LLMS.values()):
        L._stop_llm(e)


def _same_weights(llm: FakeLLM, state_dict) -> bool:
    return all(torch.equal(llm.weights[k].float(), v.to(torch.bfloat16).float()) for k, v in state_dict.items()
               if k in llm.weights)


def _perturbed(state_dict):
    return {k: v + 0.25 for k, v in state_dict.items()}


def test_llm_cap_stops_the_least_recently_used_and_restarts_it_with_its_last_weights_exact(fake_vllm, monkeypatch):
    monkeypatch.setenv("FP8RL_VLLM_MAX_LLMS", "2")
    eng = V.VllmEngine()
    m = fixtures.tiny_model("tiny-qwen3")
    h_bf16 = eng.rollout_init(m.config, m.state_dict, "bf16")
    h_kv = eng.rollout_init(m.config, m.state_dict, "fp8-kv")
    newer = _perturbed(m.state_dict)
    eng.update_weights(h_bf16, newer)  # h_bf16 is now the most recently used, holding other weights
    first = FakeLLM.started[0]
    assert len(FakeLLM.started) == 2 and _same_weights(first, newer)

    eng.rollout_init(m.config, m.state_dict, "fp8-linear-ptpc")  # a third: the least recently used (fp8-kv) stops
    assert [llm.stopped for llm in FakeLLM.started] == [False, True, False]
    assert sum(e[0] is not None for e in L._LLMS.values()) == 2

    revived = L.live_llm(h_kv["entry"])  # the stopped one, used again: started again, bf16 (LRU now) stops
    assert len(FakeLLM.started) == 4 and revived is FakeLLM.started[3]
    assert _same_weights(revived, m.state_dict) and revived.kwargs["kv_cache_dtype"] == "fp8"
    assert first.stopped and h_kv["entry"][0] is revived

    again = L.live_llm(h_bf16["entry"])  # restarted with the weights update_weights last gave it, not the initial
    assert _same_weights(again, newer) and not _same_weights(again, m.state_dict)
    assert h_bf16["entry"][1] == digest_state_dict(newer)
    assert sum(e[0] is not None for e in L._LLMS.values()) == 2


def test_llm_rollout_init_of_a_stopped_entry_starts_it_with_the_requested_weights_exact(fake_vllm, monkeypatch):
    monkeypatch.setenv("FP8RL_VLLM_MAX_LLMS", "1")
    eng = V.VllmEngine()
    m = fixtures.tiny_model("tiny-qwen3")
    eng.rollout_init(m.config, m.state_dict, "bf16")
    eng.rollout_init(m.config, m.state_dict, "fp8-kv")  # stops the bf16 LLM
    newer = _perturbed(m.state_dict)
    h = eng.rollout_init(m.config, newer, "bf16")
    assert len(FakeLLM.started) == 3 and _same_weights(FakeLLM.started[2], newer)
    assert h["entry"][1] == digest_state_dict(newer)
    assert [llm.stopped for llm in FakeLLM.started] == [True, True, False]


def test_llm_kv_cache_is_explicit_unless_the_user_sized_it_exact(fake_vllm, monkeypatch):
    eng = V.VllmEngine()
    m = fixtures.tiny_model("tiny-qwen3")
    eng.rollout_init(m.config, m.state_dict, "bf16")
    assert FakeLLM.started[0].kwargs["kv_cache_memory_bytes"] == L.DEFAULT_KV_CACHE_BYTES
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's CPU platform applies it: the adapter leaves it
    eng.rollout_init(m.config, m.state_dict, "fp8-kv")
    assert FakeLLM.started[1].kwargs["kv_cache_memory_bytes"] is None


@pytest.mark.parametrize("raw", ["0", "-1", "two"])
def test_llm_cap_rejects_a_bad_setting(monkeypatch, raw):
    monkeypatch.setenv("FP8RL_VLLM_MAX_LLMS", raw)
    with pytest.raises(ValueError, match="FP8RL_VLLM_MAX_LLMS: expected a positive integer"):
        L.max_live_llms()
