"""The vLLM adapter's pool of ``vllm.LLM`` instances (suite/engines/vllm/pool.py): starting one beyond
``FP8RL_VLLM_MAX_LLMS`` stops the least recently used, which starts again, with the weights it last held, when a
handle uses it; the checkpoint loader's one LLM at a time (suite/engines/vllm/checkpoint.py); both stopped at exit.
Driven with a stand-in ``vllm`` module (records each start, its checkpoint and each stop), so it runs without vLLM;
the real engine's memory is measured in the vllm tier."""

from __future__ import annotations

import logging
import os
import sys
import types
from collections import OrderedDict

import pytest
import torch
from fp8rl import fixtures
from fp8rl.engines import vllm as V
from fp8rl.engines.vllm import checkpoint as C
from fp8rl.engines.vllm import llm as L
from fp8rl.engines.vllm import pool as P
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
    monkeypatch.setattr(P, "_LLMS", OrderedDict())
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    FakeLLM.started = []
    yield
    P.stop_all()


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
    assert sum(e.llm is not None for e in P._LLMS.values()) == 2

    revived = P.live_llm(h_kv["entry"])  # the stopped one, used again: started again, bf16 (LRU now) stops
    assert len(FakeLLM.started) == 4 and revived is FakeLLM.started[3]
    assert _same_weights(revived, m.state_dict) and revived.kwargs["kv_cache_dtype"] == "fp8"
    assert first.stopped and h_kv["entry"].llm is revived

    again = P.live_llm(h_bf16["entry"])  # restarted with the weights update_weights last gave it, not the initial
    assert _same_weights(again, newer) and not _same_weights(again, m.state_dict)
    assert h_bf16["entry"].digest == digest_state_dict(newer)
    assert sum(e.llm is not None for e in P._LLMS.values()) == 2


def test_llm_rollout_init_of_a_stopped_entry_starts_it_with_the_requested_weights_exact(fake_vllm, monkeypatch):
    monkeypatch.setenv("FP8RL_VLLM_MAX_LLMS", "1")
    eng = V.VllmEngine()
    m = fixtures.tiny_model("tiny-qwen3")
    eng.rollout_init(m.config, m.state_dict, "bf16")
    eng.rollout_init(m.config, m.state_dict, "fp8-kv")  # stops the bf16 LLM
    newer = _perturbed(m.state_dict)
    h = eng.rollout_init(m.config, newer, "bf16")
    assert len(FakeLLM.started) == 3 and _same_weights(FakeLLM.started[2], newer)
    assert h["entry"].digest == digest_state_dict(newer)
    assert [llm.stopped for llm in FakeLLM.started] == [True, True, False]


def test_llm_kv_cache_is_explicit_unless_the_user_sized_it_exact(fake_vllm, monkeypatch):
    eng = V.VllmEngine()
    m = fixtures.tiny_model("tiny-qwen3")
    eng.rollout_init(m.config, m.state_dict, "bf16")
    assert FakeLLM.started[0].kwargs["kv_cache_memory_bytes"] == P.DEFAULT_KV_CACHE_BYTES
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's CPU platform applies it: the adapter leaves it
    eng.rollout_init(m.config, m.state_dict, "fp8-kv")
    assert FakeLLM.started[1].kwargs["kv_cache_memory_bytes"] is None


@pytest.mark.parametrize("raw", ["0", "-1", "two"])
def test_llm_cap_rejects_a_bad_setting(monkeypatch, raw):
    monkeypatch.setenv("FP8RL_VLLM_MAX_LLMS", raw)
    with pytest.raises(ValueError, match="FP8RL_VLLM_MAX_LLMS: expected a positive integer"):
        P.max_live_llms()


@pytest.fixture
def no_checkpoint_llm(fake_vllm, monkeypatch):
    monkeypatch.setattr(C, "_current", None)
    monkeypatch.setattr(C, "_FAILED", {})
    yield
    if C._current is not None:
        P.stop_llm(C._current.llm)


def _checkpoint_dir(root, name: str):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_checkpoint_llm_is_shared_by_one_checkpoint_and_stopped_for_another_exact(no_checkpoint_llm, tmp_path):
    a, b = _checkpoint_dir(tmp_path, "a"), _checkpoint_dir(tmp_path, "b")
    first = C._checkpoint_llm(a)
    assert C._checkpoint_llm(a) is first and len(FakeLLM.started) == 1  # checkpoint_load then checkpoint_score
    second = C._checkpoint_llm(b)
    assert len(FakeLLM.started) == 2 and first.stopped and not second.stopped
    st = os.stat(b / "config.json")
    os.utime(b / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # b rewritten in place
    third = C._checkpoint_llm(b)
    assert len(FakeLLM.started) == 3 and second.stopped and third.kwargs["max_num_seqs"] == 8


def test_checkpoint_llm_that_failed_to_start_is_not_started_again(no_checkpoint_llm, tmp_path, monkeypatch):
    tries = []

    def failing(model, **kwargs):
        tries.append(model)
        raise ValueError("Failed to find a kernel that can implement the ScaledMM linear layer")

    monkeypatch.setattr(sys.modules["vllm"], "LLM", failing)
    bad = _checkpoint_dir(tmp_path, "bad")
    with pytest.raises(ValueError, match="Failed to find a kernel"):
        C._checkpoint_llm(bad)
    with pytest.raises(RuntimeError, match=r"^ValueError: Failed to find a kernel .*\(the same checkpoint failed to "
                                           r"start vllm.LLM before\)$"):
        C._checkpoint_llm(bad)
    assert tries == [str(bad)]


def test_exit_stops_the_pooled_llms_and_the_checkpoint_llm_exact(no_checkpoint_llm, tmp_path, monkeypatch):
    vllm_logger = logging.getLogger("vllm")  # _shutdown_all silences logging: restored after the test
    monkeypatch.setattr(logging, "raiseExceptions", logging.raiseExceptions)
    monkeypatch.setattr(vllm_logger, "handlers", list(vllm_logger.handlers))
    monkeypatch.setattr(vllm_logger, "propagate", vllm_logger.propagate)
    m = fixtures.tiny_model("tiny-qwen3")
    h = V.VllmEngine().rollout_init(m.config, m.state_dict, "bf16")
    pooled, started_from = h["entry"].llm, h["entry"].checkpoint_dir
    held = C._checkpoint_llm(_checkpoint_dir(tmp_path, "a"))
    assert os.path.isdir(started_from) and not pooled.stopped and not held.stopped
    P._shutdown_all()
    assert pooled.stopped and held.stopped
    assert not os.path.exists(started_from) and not P._LLMS and C._current is None
