"""The rollout throughput harness against in-test engines that implement the documented ``rollout`` interface.

No timing assertions: the fake engines return instantly; only structure, order, validation and exit codes are
checked.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from fp8rl.engine import Engine
from fp8rl.perf import harness
from fp8rl.perf.results import ResultError, ingest_vllm, load_result, validate, write_result
from fp8rl.reference.rollout import RolloutOutput

TINY = ("tiny", {"vocab_size": 50, "model_type": "qwen3"}, {}, None)  # (name, config, state_dict, path)


class FakeRolloutEngine(Engine):
    """Implements the engine protocol's rollout ops (fp8rl.engine, e2e section); records every call."""

    name = "fake-rollout"

    def __init__(self, short_config: str | None = None, unsupported: dict | None = None,
                 with_stats: bool = True, as_tuple: bool = False, step_sleep_s: float = 0.0) -> None:
        self.calls: list[tuple] = []
        self.step_sleep_s = step_sleep_s  # a fixed cost per rollout, so wall-clock ratios aren't scheduling jitter
        self.short_config = short_config
        self.unsupported = unsupported or {}
        self.with_stats = with_stats
        self.as_tuple = as_tuple

    def version(self) -> str:
        return "fake 1.0"

    def capabilities(self):
        caps = {"rollout": True, "rollout.bf16": True, "rollout.fp8-linear": True, "rollout.fp8-kv": True,
                "rollout.fp8-all": True}
        caps.update({f"rollout.{k}": v for k, v in self.unsupported.items()})
        return caps

    def rollout_init(self, config, state_dict, recipe):
        self.calls.append(("init", recipe))
        return {"recipe": recipe}

    def rollout(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        cfg = handle["recipe"]
        self.calls.append((cfg, max_new_tokens, tuple(map(tuple, prompts.tolist()))))
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        n = max_new_tokens - 3 if cfg == self.short_config else max_new_tokens
        toks = torch.cat([prompts, torch.full((prompts.shape[0], n), 7, dtype=torch.int64)], 1)
        lp = torch.zeros(prompts.shape[0], n)
        return (toks, lp) if self.as_tuple else RolloutOutput(toks, lp)

    def rollout_stats(self, handle):
        if not self.with_stats:
            return None
        return {"kv_capacity_tokens": 1000 if handle["recipe"] in ("bf16", "fp8-linear") else 2000}


class NoRolloutEngine(Engine):
    name = "no-rollout"

    def capabilities(self):
        return {"cast.e4m3fn": True, "rollout": "generation is not implemented by this engine"}


def make_fake():
    # 20 ms per rollout: the CLI test gates a run against itself, and a microsecond fake's wall-clock samples can
    # differ 20-fold on a loaded machine (CI: it failed at a 95% regression floor while other jobs shared the cores)
    return FakeRolloutEngine(step_sleep_s=0.02)


def make_eos_fake():
    return FakeRolloutEngine(short_config="fp8-kv")


def make_no_rollout():
    return NoRolloutEngine()


def _run(engine, **kw):
    args = dict(model="tiny", configs=["bf16", "fp8-kv"], batch=3, prompt_len=5, gen_len=4, repeats=3, warmup=1,
                seed=1, loaded=TINY)
    args.update(kw)
    return harness.run_benchmark(engine, **args)


def test_interleaved_paired_repeats_same_prompts():
    eng = FakeRolloutEngine()
    res = _run(eng)
    validate(res)
    # init per config, warm-up one per config, then A B A B A B
    assert [c[:2] for c in eng.calls[:2]] == [("init", "bf16"), ("init", "fp8-kv")]
    gen = [c for c in eng.calls if c[0] != "init"]
    assert [c[0] for c in gen] == ["bf16", "fp8-kv"] + ["bf16", "fp8-kv"] * 3
    assert len({c[2] for c in gen}) == 1  # identical prompts for every call
    prompts = gen[0][2]
    assert len(prompts) == 3 and all(len(p) == 5 and all(3 <= t < 50 for t in p) for p in prompts)
    assert [(r["config"], r["repeat"], r["seq"]) for r in res["runs"]] == [
        ("bf16", 0, 0), ("fp8-kv", 0, 1), ("bf16", 1, 2), ("fp8-kv", 1, 3), ("bf16", 2, 4), ("fp8-kv", 2, 5)]
    r0 = res["runs"][0]
    assert r0["tokens"] == 12 and r0["valid"] and r0["throughput"] > 0 and r0["wall_s"] > 0
    assert r0["kv_capacity_tokens"] == 1000 and res["runs"][1]["kv_capacity_tokens"] == 2000
    assert r0["peak_memory_bytes"] is None or r0["peak_memory_bytes"] > 0
    assert res["summary"]["fp8-kv"]["valid_runs"] == 3
    wl = res["workload"]
    assert {k: wl[k] for k in ("batch", "prompt_len", "gen_len", "repeats", "warmup", "seed", "order")} == {
        "batch": 3, "prompt_len": 5, "gen_len": 4, "repeats": 3, "warmup": 1, "seed": 1, "order": "interleaved"}
    assert wl["ignore_eos"] is True and wl["vocab_size"] == 50 and set(wl["init_s"]) == {"bf16", "fp8-kv"}
    env = res["environment"]
    for key in ("python", "cpu", "torch", "numpy", "platform", "gpus", "engine"):
        assert key in env
    assert env["engine"] == {"name": "fake-rollout", "version": "fake 1.0"}
    assert res["engine"]["version"] == "fake 1.0" and res["baseline_config"] == "bf16"
    # the kind of CPU (vLLM's CPU kernels differ with AMX tiles): recorded, and the one vendor conditions read
    assert env["cpu_features"] == (["amx"] if torch.cpu._is_amx_tile_supported() else [])
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()



class SlowConfigEngine(FakeRolloutEngine):
    """fp8-kv costs 10 ms per generated token, bf16 nothing: a config an order of magnitude slower than the baseline
    (as vLLM's FP8 PTPC linear on an AMX CPU)."""

    def rollout(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        if handle["recipe"] == "fp8-kv":
            time.sleep(0.01 * max_new_tokens)
        return super().rollout(handle, prompts, max_new_tokens, greedy=greedy, seed=seed)


def test_estimated_config_time_from_the_two_pilots_bound():
    # 1-token forward 1.0 s, 11-token prefill 2.0 s: c = 0.1 s per token, s = 0.9 s per step; batch 4, 11 + 5 tokens,
    # 2 calls: prefill 0.9 + 44 x 0.1 = 5.3 s, 4 decode steps of 0.9 + 0.4 = 5.2 s, 2 x 10.5 = 21 s (by hand)
    est = harness.estimated_config_s(1.0, 2.0, short_len=1, batch=4, prompt_len=11, gen_len=5, calls=2)
    assert est == pytest.approx(21.0, rel=1e-12)
    # the same machine seen through an 8-token pilot (s + 8c = 1.7 s) gives the same estimate
    est = harness.estimated_config_s(1.7, 2.0, short_len=8, batch=4, prompt_len=11, gen_len=5, calls=2)
    assert est == pytest.approx(21.0, rel=1e-12)
    # a long pilot faster than the short one (noise) gives c = 0: every step costs the short forward
    assert harness.estimated_config_s(1.0, 0.5, short_len=1, batch=4, prompt_len=11, gen_len=5,
                                      calls=2) == pytest.approx(10.0)
    # prompts no longer than the short pilot: one pilot, c = 0
    assert harness.estimated_config_s(1.0, 1.0, short_len=5, batch=4, prompt_len=5, gen_len=5,
                                      calls=2) == pytest.approx(10.0)


def test_config_over_the_budget_is_not_timed_and_says_why_bound():
    """gen_len 40, 1 warm-up + 3 repeats: fp8-kv's pilot (2 tokens, >= 20 ms) estimates >= 4 x 20 ms x 20 = 1.6 s,
    over a 1 s budget; bf16 (the baseline) always runs. Without a budget both are timed and nothing is piloted."""
    eng = SlowConfigEngine()
    res = _run(eng, gen_len=40, prompt_len=12, config_budget_s=1.0)
    validate(res)
    gen = [c for c in eng.calls if c[0] != "init"]
    # the pilots: one row, one new token, an 8-token then the 12-token prompt (fp8-kv: its short pilot, 10 ms, times
    # 4 calls x 40 tokens is over the budget already, so no second pilot)
    assert [(c[0], c[1], len(c[2]), len(c[2][0])) for c in gen[:3]] == [
        ("bf16", 1, 1, 8), ("bf16", 1, 1, 12), ("fp8-kv", 1, 1, 8)]
    assert [c[0] for c in gen[3:]] == ["bf16"] * 4 and {r["config"] for r in res["runs"]} == {"bf16"}
    why = res["workload"]["skipped_configs"]["fp8-kv"]
    assert "pilot rollouts of one row and one new token" in why and "over the per-config budget of 1 s" in why
    assert res["workload"]["config_budget_s"] == 1.0 and res["summary"]["fp8-kv"]["runs"] == 0
    eng = SlowConfigEngine()
    res = _run(eng, gen_len=4)
    assert "skipped_configs" not in res["workload"] and all(c[1] == 4 for c in eng.calls if c[0] != "init")
    res = _run(SlowConfigEngine(), gen_len=4, config_budget_s=60.0)
    assert res["workload"]["skipped_configs"] == {} and {r["config"] for r in res["runs"]} == {"bf16", "fp8-kv"}


class DyingConfigEngine(FakeRolloutEngine):
    """A config whose engine dies on its first call (vLLM: 'EngineDeadError')."""

    def __init__(self, dies: str) -> None:
        super().__init__()
        self.dies = dies

    def rollout(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        if handle["recipe"] == self.dies:
            raise RuntimeError("EngineCore encountered an issue")
        return super().rollout(handle, prompts, max_new_tokens, greedy=greedy, seed=seed)


def test_config_whose_pilot_raises_is_not_timed_and_the_baseline_raises():
    res = _run(DyingConfigEngine("fp8-kv"), config_budget_s=60.0)
    assert res["workload"]["skipped_configs"] == {
        "fp8-kv": "not timed: its pilot rollout raised RuntimeError: EngineCore encountered an issue"}
    assert {r["config"] for r in res["runs"]} == {"bf16"}
    with pytest.raises(RuntimeError, match="EngineCore"):
        _run(DyingConfigEngine("bf16"), config_budget_s=60.0)

@pytest.mark.parametrize("budget", [0, -1.0, True, "10"])
def test_config_budget_must_be_positive_seconds(budget):
    with pytest.raises(ValueError, match="config_budget_s: expected a positive number"):
        _run(FakeRolloutEngine(), config_budget_s=budget)

def test_abba_order_and_tuple_output_without_stats():
    eng = FakeRolloutEngine(with_stats=False, as_tuple=True)
    res = _run(eng, configs=["bf16", "fp8-linear", "fp8-all"], order="abba", warmup=0, repeats=2)
    gen = [c[0] for c in eng.calls if c[0] != "init"]
    assert gen == ["bf16", "fp8-linear", "fp8-all", "fp8-all", "fp8-linear", "bf16"]
    assert all(r["kv_capacity_tokens"] is None and r["valid"] for r in res["runs"])


def test_short_responses_mark_runs_invalid():
    res = _run(FakeRolloutEngine(short_config="fp8-kv"))
    bad = [r for r in res["runs"] if not r["valid"]]
    assert len(bad) == 3 and all(r["config"] == "fp8-kv" for r in bad)
    assert "shorter than gen_len=4" in bad[0]["problems"][0]


def test_changed_prompt_prefix_is_invalid():
    class Rewriter(FakeRolloutEngine):
        def rollout(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
            out = super().rollout(handle, prompts, max_new_tokens, greedy=greedy, seed=seed)
            return RolloutOutput(out.tokens.flip(1), out.logprobs)

    res = _run(Rewriter(), repeats=1, warmup=0)
    assert not res["runs"][0]["valid"] and "start with the prompts" in res["runs"][0]["problems"][0]


def test_capability_missing_or_config_unsupported():
    with pytest.raises(harness.RolloutUnavailable, match="not implemented by this engine"):
        _run(NoRolloutEngine())
    with pytest.raises(harness.RolloutUnavailable, match="no FP8 attention"):
        _run(FakeRolloutEngine(unsupported={"fp8-kv": "no FP8 attention on CPU"}))

    class Undeclared(Engine):
        name = "bare"

    with pytest.raises(harness.RolloutUnavailable, match="does not declare capability 'rollout'"):
        _run(Undeclared())


@pytest.mark.parametrize("kw,match", [({"configs": []}, "configs"), ({"configs": ["bf16", "bf16"]}, "duplicates"),
                                      ({"repeats": 0}, "repeats"), ({"order": "random"}, "order"),
                                      ({"configs": ["int4"]}, "unknown config")])
def test_argument_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        _run(FakeRolloutEngine(), **kw)


def test_result_roundtrip_and_schema_errors(tmp_path):
    res = _run(FakeRolloutEngine())
    p = write_result(res, tmp_path / "r.json")
    assert load_result(p)["runs"] == json.loads(p.read_text())["runs"]
    broken = dict(res, baseline_config="fp8-all")
    with pytest.raises(ResultError, match="baseline_config"):
        validate(broken)
    dup = dict(res, runs=res["runs"] + [res["runs"][0]])
    with pytest.raises(ResultError, match="duplicate"):
        validate(dup)
    (tmp_path / "x.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ResultError, match="not a fp8rl.perf.result"):
        load_result(tmp_path / "x.json")
    with pytest.raises(ResultError, match="no such file"):
        load_result(tmp_path / "missing.json")


def _vllm_file(path, tps, elapsed=10.0, n=100):
    path.write_text(json.dumps({"elapsed_time": elapsed, "num_requests": n, "total_num_tokens": int(tps * elapsed),
                                "requests_per_second": n / elapsed, "tokens_per_second": tps}))
    return str(path)


def test_ingest_vllm_bench_files(tmp_path):
    a = [_vllm_file(tmp_path / f"a{i}.json", 1000.0 + i) for i in range(3)]
    b = [_vllm_file(tmp_path / f"b{i}.json", 1150.0 + i, elapsed=8.0) for i in range(3)]
    res = ingest_vllm([("bf16", a), ("fp8", b)], model_name="Qwen/Qwen3-8B-Base",
                      hardware={"name": "H100-SXM-80GB", "class": "hopper", "device": "H100"})
    validate(res)
    assert res["configs"] == ["bf16", "fp8-linear"] and res["metric"] == "total_tokens_per_s"
    assert [(r["config"], r["repeat"]) for r in res["runs"]][:2] == [("bf16", 0), ("fp8-linear", 0)]
    out = ingest_vllm([("bf16", a), ("fp8-linear", b)], model_name="m", hardware={}, gen_len=512)
    assert out["metric"] == "output_tokens_per_s"
    assert out["runs"][1]["throughput"] == pytest.approx(100 * 512 / 8.0)
    # raw vLLM files are refused by the gate loader with a pointer to ingest
    with pytest.raises(ResultError, match="perf ingest"):
        load_result(a[0])
    with pytest.raises(ResultError, match="baseline"):
        ingest_vllm([("fp8-linear", b)], model_name="m", hardware={})
    with pytest.raises(ResultError, match="cannot infer"):
        ingest_vllm([(None, a)], model_name="m", hardware={})


def test_ingest_pytorch_benchmark_format_infers_config(tmp_path):
    def rec(path, quant, kv, tps):
        args = {"model": "Qwen/Qwen3-8B", "quantization": quant, "kv_cache_dtype": kv, "input_len": 1024,
                "output_len": 4096, "num_prompts": 64}
        path.write_text(json.dumps([
            {"benchmark": {"name": "vLLM benchmark", "extra_info": {"args": args}}, "model": {"name": "x"},
             "metric": {"name": "requests_per_second", "benchmark_values": [1.0], "extra_info": {}}},
            {"benchmark": {"name": "vLLM benchmark", "extra_info": {"args": args}}, "model": {"name": "x"},
             "metric": {"name": "tokens_per_second", "benchmark_values": [tps], "extra_info": {}}}]))
        return str(path)

    files = [rec(tmp_path / "1.json", None, "auto", 100.0), rec(tmp_path / "2.json", "fp8", "fp8", 140.0),
             rec(tmp_path / "3.json", None, "auto", 101.0), rec(tmp_path / "4.json", "fp8", "fp8", 141.0)]
    res = ingest_vllm([(None, files)], model_name="Qwen3-8B", hardware={})
    assert res["configs"] == ["bf16", "fp8-all"]
    assert res["workload"]["gen_len"] == 4096 and res["workload"]["batch"] == 64
    assert [r["repeat"] for r in res["runs"] if r["config"] == "fp8-all"] == [0, 1]


def test_load_model_from_checkpoint_dir_and_errors(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        harness.load_model(str(d))
    (d / "config.json").write_text(json.dumps({"vocab_size": 64, "_name_or_path": "org/my-model"}))
    with pytest.raises(ValueError, match="safetensors"):
        harness.load_model(str(d))
    save_file({"w": torch.ones(2, 2, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
    name, cfg, sd, path = harness.load_model(str(d))
    assert name == "org/my-model" and cfg["vocab_size"] == 64 and set(sd) == {"w"} and path == str(d)
    with pytest.raises(ValueError, match="neither"):
        harness.load_model("no-such-model")
