"""The veRL engine adapter: behaviour without veRL (base environment), and — where verl is installed (the
``conformance_verl`` nox session) — the adapter's mapping and executable evidence of every recorded finding."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from fp8rl.engine import Unsupported, capability_reason
from fp8rl.engines import verl as V
from fp8rl.reference import correction as C
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import pinned

#: every test here that needs the installed package pins its behaviour (tests/support/upstream.py)
PIN = pinned("verl", "==0.9.1", "veRL 0.9.1's rollout correction and FP8 weight sync")

XFAILS = REPO_ROOT / "conformance" / "vendors" / "verl.xfails"
CAPS = ("rollout_correction", "rollout_correction.geometric", "rollout_correction.veto", "rollout_correction.loss")


def test_without_verl_every_capability_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)  # `import verl` now fails as if it were not installed
    eng = V.VerlEngine()
    assert eng.name == "verl" and eng.version() == "verl not installed"
    for key in CAPS:
        reason = capability_reason(eng, key)
        assert reason is not None and reason.startswith("verl not installed: pip install"), reason
    with pytest.raises(Unsupported, match="verl not installed"):
        eng.rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), C.CorrectionConfig())
    with pytest.raises(Unsupported, match="verl not installed"):
        eng.correction_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), None,
                            C.LossConfig())


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=41)


# ----------------------------------------------------------------------------------------------------------------
# with veRL installed

verl_only = pytest.mark.skipif(V._import_verl()[0] is None, reason=V.INSTALL_HINT)


@pytest.fixture(scope="module")
def eng():
    return V.VerlEngine()


@verl_only
@PIN
def test_capabilities_with_verl(eng):
    caps = eng.capabilities()
    assert caps["rollout_correction"] is True and caps["rollout_correction.loss"] is True
    assert "token" in str(caps["rollout_correction.geometric"]) and "#4544" in str(caps["rollout_correction.veto"])
    assert eng.version().startswith("verl 0.9")


@verl_only
@PIN
def test_metric_mapping_covers_offpolicy_is_rs(eng):
    lo = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, 0.0]])
    lr = torch.tensor([[-1.2, -1.5, -0.5], [-0.4, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    cfg = C.CorrectionConfig("token", 1.5, rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.1,0.5")
    got = eng.rollout_correction(lo, lr, mask, cfg)
    ref = C.rollout_correction(lo, lr, mask, cfg)
    missing = set(ref.metrics) - set(got.metrics)
    # NeMo-RL's metric and TRL's (weight min/max/row mean, |δ| mean/max) have no veRL counterpart
    assert missing == {"token_mult_prob_error", "is_weight_min", "is_weight_max", "is_weight_row_mean",
                       "abs_logp_diff_mean", "abs_logp_diff_max"}
    for k, v in ref.metrics.items():
        if k in got.metrics:
            assert got.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    torch.testing.assert_close(got.weights, ref.weights)
    assert torch.equal(got.mask, ref.mask)


# Executable evidence of each finding in conformance/vendors/verl.xfails (if veRL fixes one, this fails first).


@verl_only
@PIN
def test_finding_k1_rs_uses_inverse_ratio(eng):
    lr = torch.full((1, 2), -2.0)
    lo = lr + torch.tensor([[math.log(3.0), -math.log(3.0)]])  # ρ = 3, 1/3
    cfg = C.CorrectionConfig(None, rollout_rs="token_k1", rollout_rs_threshold="0.9_4.0")
    assert eng.rollout_correction(lo, lr, torch.ones(1, 2), cfg).mask.tolist() == [[0.0, 1.0]]
    assert C.rollout_correction(lo, lr, torch.ones(1, 2), cfg).mask.tolist() == [[1.0, 0.0]]


@verl_only
@PIN
def test_finding_icepop_all_zero_crashes(eng):
    lr = torch.full((1, 2), -1.0)
    with pytest.raises(ZeroDivisionError):
        eng.rollout_correction(lr + 3.0, lr, torch.ones(1, 2), C.CorrectionConfig("token", "0.5_5.0"))
    assert C.rollout_correction(lr + 3.0, lr, torch.ones(1, 2), C.CorrectionConfig("token", "0.5_5.0")).metrics[
        "is_ess"] == 0.0


@verl_only
@PIN
def test_finding_nan_weights_at_nonfinite_padding(eng):
    lo = torch.tensor([[-1.0, -math.inf]])
    lr = torch.tensor([[-1.2, -math.inf]])
    w = eng.rollout_correction(lo, lr, torch.tensor([[1.0, 0.0]]), C.CorrectionConfig("token", 2.0)).weights
    assert math.isnan(float(w[0, 1]))


@verl_only
@PIN
def test_finding_empty_rows_count_in_row_means(eng):
    lo = torch.tensor([[-1.0, -2.0], [-3.0, -3.0]])
    lr = torch.tensor([[-1.5, -2.5], [-1.0, -1.0]])
    cfg = C.CorrectionConfig("sequence", 2.0)
    with_empty = eng.rollout_correction(lo, lr, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), cfg).metrics
    alone = eng.rollout_correction(lo[:1], lr[:1], torch.ones(1, 2), cfg).metrics
    assert with_empty["training_log_ppl"] == pytest.approx(alone["training_log_ppl"] / 2)  # (1.5 + 0) / 2
    assert with_empty["is_fraction_high"] == pytest.approx(alone["is_fraction_high"] / 2)


@verl_only
@PIN
def test_finding_unclamped_k3_kl_and_ppl_ratio(eng):
    m = torch.ones(1, 2)
    got = eng.rollout_correction(torch.tensor([[-0.5, -1.0]]), torch.tensor([[-3000.0, -1.0]]), m,
                                 C.CorrectionConfig(None)).metrics
    assert math.isinf(got["kl_k3"]) and math.isfinite(got["chi2_token"])
    got = eng.rollout_correction(torch.tensor([[-1e4, -1.0]]), torch.tensor([[-0.5, -1.0]]), m,
                                 C.CorrectionConfig(None)).metrics
    assert math.isinf(got["ppl_ratio"])


@verl_only
@PIN
def test_finding_probs_diff_std_nan_for_one_token(eng):
    got = eng.rollout_correction(torch.tensor([[-1.0]]), torch.tensor([[-1.1]]), torch.ones(1, 1),
                                 C.CorrectionConfig(None)).metrics
    assert math.isnan(got["probs_diff_std"])


@verl_only
@pytest.mark.parametrize("kind", C.LOSS_KINDS)
@PIN
def test_loss_matches_oracle(eng, kind):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(3, 5, generator=g) * 0.2
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] + [0.0] * 4])
    w = torch.rand(3, 5, generator=g) * 2
    for agg in C.LOSS_AGG_MODES:
        cfg = C.LossConfig(kind=kind, agg=agg)
        got = eng.correction_loss(logp, old, adv, mask, w, cfg)
        ref = C.policy_loss(logp, old, adv, mask, w, cfg)
        assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7), agg


def test_threshold_mapping_exact():
    assert V.VerlEngine._is_threshold((0.5, 5)) == "0.5_5.0" and V.VerlEngine._is_threshold(2.0) == 2.0
    assert V.VerlEngine._rs_threshold([(0.5, 2.0), 3.0, "0.1_9"]) == "0.5_2.0,3.0,0.1_9"
    assert V.VerlEngine._rs_threshold("0.5_2.0,3") == "0.5_2.0,3"


# ----------------------------------------------------------------------------------------------------------------
# weight sync (capability ``weight_sync``): veRL's real SGLang/TRT-LLM quantizer + name filter, PyTorch path


def test_without_verl_weight_sync_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)
    eng = V.VerlEngine()
    reason = capability_reason(eng, "weight_sync")
    assert reason is not None and reason.startswith("verl not installed: pip install"), reason
    with pytest.raises(Unsupported, match="verl not installed"):
        eng.weight_sync({})


verl_ws_only = pytest.mark.skipif(V._import_verl()[0] is None or V._import_verl_fp8()[0] is None,
                                  reason=V._import_verl_fp8()[1] or V.INSTALL_HINT)

_Q = "model.layers.0.self_attn.q_proj.weight"


def _weight_with_zero_block() -> torch.Tensor:
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(200, 320, generator=g) * 0.02).to(torch.bfloat16)  # partial edge blocks both ways
    w[:128, :128] = 0
    return w


@verl_ws_only
@PIN
def test_weight_sync_capability_and_declared_policy(eng):
    from fp8rl.reference.presets import get_policy

    assert eng.capabilities()["weight_sync"] is True
    assert eng.scale_policy("block") == get_policy("verl_torch")
    with pytest.raises(Unsupported):
        eng.scale_policy("group")
    assert V.FP8_UTILS_IMPORT["how"] == "real" or V.FP8_UTILS_IMPORT["how"].startswith("stand-in")
    fk = V._import_verl_fp8()[0].fp8_kernel  # scaled_fp8_blockwise takes its PyTorch path
    assert fk._DISABLE_TRITON_FP8 or not fk.is_triton_available()


@verl_ws_only
@PIN
def test_weight_sync_bit_exact_vs_verl_torch_preset_and_zero_block_scale_one(eng):
    """veRL's PyTorch path == the oracle's verl_torch preset, bit for bit (partial edge blocks, ceil-div scale
    grid); an all-zero block gets dequant scale 1.0 (the oracle's default and veRL's Triton path: 1e-10/448)."""
    from fp8rl.reference import weight_sync as ws

    sd = {_Q: _weight_with_zero_block()}
    got = eng.weight_sync(sd)
    assert set(got) == {_Q, _Q + "_scale_inv"}
    want = ws.quantize_state_dict(sd, ws.WeightSyncRecipe(policy="verl_torch"))
    s = got[_Q + "_scale_inv"]
    assert got[_Q].dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (2, 3)
    assert torch.equal(got[_Q].view(torch.uint8), want[_Q].view(torch.uint8))
    assert torch.equal(s, want[_Q + "_scale_inv"])
    assert s[0, 0].item() == 1.0
    for other in ("reference", "verl_triton"):
        o = ws.quantize_state_dict(sd, ws.WeightSyncRecipe(policy=other))[_Q + "_scale_inv"]
        assert o[0, 0].item() == pytest.approx(1e-10 / 448, rel=1e-6)


@verl_ws_only
@PIN
def test_weight_sync_declared_policy_is_not_the_default(eng):
    """On the tiny dense fixture the verl_torch preset differs from the oracle's default (s = 1/(448/a) vs a/448
    moves scales by an ulp and flips codes), so the bit-exact WSYNC checks do test the declaration."""
    from fp8rl import fixtures
    from fp8rl.reference import weight_sync as ws

    sd = fixtures.tiny_model("tiny-qwen3").state_dict
    a = ws.quantize_state_dict(sd, ws.WeightSyncRecipe(policy="verl_torch"))
    b = ws.quantize_state_dict(sd, ws.WeightSyncRecipe(policy="reference"))
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith("_scale_inv"))


@verl_ws_only
@PIN
def test_finding_name_filter_quantizes_shared_expert_gate(eng):
    """veRL's SGLang/TRT-LLM filter includes any '.weight' containing 'mlp': a Qwen2-MoE-style
    mlp.shared_expert_gate.weight (a (1, hidden) gate, not a projection) is shipped FP8; the spec keeps it BF16.
    (WSYNC-EXCL-001 and WSYNC-NAMES-001 see it on the tiny-qwen2-moe fixture.)"""
    from fp8rl.reference import weight_sync as ws

    name = "model.layers.0.mlp.shared_expert_gate.weight"
    sd = {name: (torch.randn(1, 320, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)}
    got = eng.weight_sync(sd)
    assert got[name].dtype == torch.float8_e4m3fn and tuple(got[name + "_scale_inv"].shape) == (1, 3)
    assert not ws.is_quantized_name(name, (1, 320))
    # the router itself is excluded by the literal "mlp.gate.weight" pattern
    router = "model.layers.0.mlp.gate.weight"
    assert eng.weight_sync({router: sd[name]})[router].dtype == torch.bfloat16


@verl_ws_only
@PIN
def test_finding_name_filter_misses_mla_and_packed_experts_and_splits_the_vision_tower(eng):
    """The same substring filter on the other families (docs/weight-sync-families.md §4): DeepSeek's MLA projections
    (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj) and transformers-5 packed experts (no '.weight' suffix) ship
    in BF16; in Qwen2.5-VL's vision tower the 'mlp' include quantizes the MLPs and the merger but not attn.qkv /
    attn.proj. (WSYNC-EXACT/NAMES/EXCL-001 on tiny-deepseek-v3, tiny-qwen3-moe-fused, tiny-qwen2.5-vl.)"""
    from fp8rl import fixtures

    ds = eng.weight_sync(fixtures.tiny_model("tiny-deepseek-v3").state_dict)
    for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        name = f"model.layers.0.self_attn.{p}.weight"
        assert ds[name].dtype == torch.bfloat16 and name + "_scale_inv" not in ds
    assert ds["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    fused = eng.weight_sync(fixtures.tiny_model("tiny-qwen3-moe-fused").state_dict)
    packed = [k for k in fused if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert len(packed) == 4 and all(fused[k].dtype == torch.bfloat16 for k in packed)
    vl = eng.weight_sync(fixtures.tiny_model("tiny-qwen2.5-vl").state_dict)
    fp8_visual = sorted(k for k, v in vl.items() if k.startswith("model.visual.") and v.dtype == torch.float8_e4m3fn)
    assert fp8_visual == ["model.visual.blocks.0.mlp.down_proj.weight", "model.visual.blocks.0.mlp.gate_proj.weight",
                          "model.visual.blocks.0.mlp.up_proj.weight", "model.visual.merger.mlp.0.weight",
                          "model.visual.merger.mlp.2.weight"]
    assert vl["model.visual.blocks.0.attn.qkv.weight"].dtype == torch.bfloat16
    assert vl["model.language_model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


@verl_ws_only
@PIN
def test_finding_silent_bf16_fallback_without_process_group(eng):
    """quant_weights_by_name calls torch.distributed.get_rank() inside try/except Exception: without a process
    group every weight is shipped unquantized BF16 (no scale), with only a log line. The adapter runs it inside a
    1-rank gloo group and leaves no group behind."""
    import asyncio

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    ns = V._import_verl_fp8()[0]
    helper = ns.sglang.SGLangFP8QuantizerHelper(ns.sglang.build_sglang_fp8_quant_config())
    sd = {_Q: _weight_with_zero_block()}

    async def drain():
        return [kv async for kv in helper.quant_weights_by_name(list(sd.items()), dtype=torch.bfloat16)]

    raw = asyncio.run(drain())
    assert [(k, v.dtype) for k, v in raw] == [(_Q, torch.bfloat16)]
    got = eng.weight_sync(sd)
    assert got[_Q].dtype == torch.float8_e4m3fn and not dist.is_initialized()


@verl_ws_only
@PIN
def test_finding_fp32_masters_ship_unquantized_tensors_in_fp32(eng):
    """quant_weights_by_name casts a weight to BF16 (v.to(dtype)) only when it quantizes it: the other tensors of an
    fp32 master state dict (embeddings, norms, router, biases, lm_head) are shipped in fp32; the FP8 codes and
    scales equal the BF16 cast's (WSYNC-MASTER-001 fails on the dtypes only)."""
    from fp8rl import fixtures
    from fp8rl.reference import weight_sync as ws

    master = fixtures.master_state_dict("tiny-qwen3-moe")
    got = eng.weight_sync(dict(master))
    want = eng.weight_sync({k: v.to(torch.bfloat16) for k, v in master.items()})
    kept = [k for k in master if k not in ws.quantized_names(master)]
    assert len(kept) == 13 and all(got[k].dtype == torch.float32 for k in kept)
    assert all(torch.equal(got[k].to(torch.bfloat16).view(torch.int16), want[k].view(torch.int16)) for k in kept)
    for k in ws.quantized_names(master):
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
        assert torch.equal(got[ws.scale_name(k)], want[ws.scale_name(k)])


@PIN
@verl_ws_only
def test_checkpoint_matrix_verl_writer_conformant(tmp_path):
    """The interop matrix with veRL as the writer (its weight sync's tensors and the quantization_config it injects
    into vLLM, in the blockwise layout): every file within the round-trip bound of the BF16 weights, the oracle loader
    holds codes x scales exactly and its model gives the oracle's log-probs; `fp8rl checkpoint-matrix` exits 0."""
    import json

    from fp8rl.cli import main

    out = tmp_path / "m"
    assert main(["checkpoint-matrix", "--writer", "verl", "--loader", "reference", "--out", str(out)]) == 0
    doc = json.loads((out / "matrix.json").read_text())
    assert doc["writers"]["verl"].startswith("verl 0.9.1")
    assert [(c["model"], c["status"], c["file"]["status"]) for c in doc["cells"]] == [
        ("tiny-qwen3", "conformant", "conformant"), ("tiny-qwen3-moe", "conformant", "conformant")]
    assert all(c["logprobs"]["max_abs_dlogp"] == 0.0 for c in doc["cells"])
