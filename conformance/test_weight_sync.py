"""Area ``weight_sync``: the FP8 checkpoint an engine's per-step weight sync produces (docs/paper-numbers.md §1.3–1.4).

For the tiny dense and MoE fixtures (BF16, HF checkpoint names), the engine's ``weight_sync`` must return FP8
codes + ``*_weight_scale_inv`` fp32 dequant scales (128×128 blocks, ceil-div shapes) for every attention/MLP/expert
projection — bit-exact vs the oracle under the engine's declared ``scale_policy("block")`` — and must keep the
embeddings, ``lm_head``, every norm and the MoE router in BF16, untouched. The dense fixture has hidden size 320:
every projection has a partial edge block and several have non-square scale grids; ``tiny-qwen3-tied-odd`` has no
projection dimension that is a multiple of 128 and tied embeddings; ``tiny-qwen2-moe`` has a shared expert (its
projections are quantized) with a shared-expert gate and q/k/v biases (kept BF16). The trainer's fp32 master weights
must sync bit for bit like their BF16 cast.

The other architecture families (``fp8rl.fixtures.FAMILY_MODELS``; each needs the engine's ``weight_sync.<family>``
capability, docs/weight-sync-families.md): ``tiny-llama`` (dense Llama), ``tiny-deepseek-v3`` (MLA attention — its
q_a/q_b/kv_a_proj_with_mqa/kv_b_proj/o_proj quantized, q_a_layernorm/kv_a_layernorm kept — and MoE whose routed
experts come packed in transformers 5's 3-D layout, DeepSeek's ``shared_experts`` and router bias),
``tiny-qwen3-moe-fused`` (tiny-qwen3-moe's weights packed the same way: each expert's slice must sync exactly as
the unfused expert does) and ``tiny-qwen2.5-vl`` (the language model under ``model.language_model.``, quantized as
any Qwen2 decoder; the vision tower ``model.visual.*`` kept BF16).

The microscaling rollout recipes (WSYNC-MX-*; fp8rl.reference.mx_weight_sync, docs/microscaling.md): ``mxfp8`` syncs
every projection as MXFP8 e4m3 + E8M0 scales, ``nvfp4-experts`` only the routed experts as NVFP4, in
compressed-tensors' names (what vLLM's compressed-tensors schemes load), bit-exact under the declared ``mx_policy``.
"""

from __future__ import annotations

import functools
import gc
import re

import pytest
import torch
from fp8rl import fixtures, tolerances
from fp8rl.capabilities import family_keys
from fp8rl.checks import assert_codes_equal, assert_tensors_equal, assert_within_bound, check, require
from fp8rl.reference import microscaling as mx
from fp8rl.reference import mx_weight_sync as mxws
from fp8rl.reference import weight_sync as ws
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.quant import Granularity

MODELS = pytest.mark.parametrize("model", fixtures.TINY_MODELS)
#: the weight-sync fixtures: the Qwen families and the other architecture families (fp8rl.fixtures.SYNC_MODELS);
#: a fixture of another family needs the engine's ``weight_sync.<family>`` capability too (:func:`_synced`)
SYNC_MODELS = pytest.mark.parametrize("model", fixtures.SYNC_MODELS)

#: the tensors that must stay BF16 (spec, independent of the engine): name pattern → why
KEEP_BF16 = {
    r"(^|\.)embed_tokens\.weight$": "embeddings",
    r"(^|\.)lm_head\.weight$": "lm_head (its logits feed sampling directly)",
    r"norm\.weight$": "norms (RMSNorm, QK-norm)",
    r"(^|\.)mlp\.gate\.weight$": "the MoE router mlp.gate",
    r"(^|\.)mlp\.shared_expert_gate\.weight$": "the shared-expert gate mlp.shared_expert_gate (router-like)",
    r"\.bias$": "biases (q/k/v, the vision tower's)",
    r"(^|\.)mlp\.gate\.e_score_correction_bias$": "DeepSeek's router bias mlp.gate.e_score_correction_bias",
    r"(^|\.)visual\.": "a multimodal model's vision tower model.visual.* (patch embedding, blocks, merger)",
}


@functools.lru_cache(maxsize=8)
def _oracle_sync(model: str, policy: ScalePolicy) -> dict[str, torch.Tensor]:
    return ws.quantize_state_dict(fixtures.tiny_model(model).state_dict, ws.WeightSyncRecipe(policy=policy))


def _require_families(engine, model: str) -> None:
    """Skip unless the engine declares ``weight_sync.<family>`` for every family of the fixture (none for Qwen's)."""
    require(engine, *family_keys("weight_sync", model))


def _synced(engine, model: str) -> dict[str, torch.Tensor]:
    _require_families(engine, model)
    return engine.weight_sync(fixtures.tiny_model(model).state_dict)  # validated by GuardedEngine


def _expected_names(model: str) -> list[str]:
    return ws.quantized_names(fixtures.tiny_model(model).state_dict)


@SYNC_MODELS
@check("WSYNC-EXACT-001", "Every quantized projection (q/k/v/o, gate/up/down, each expert's) has FP8 codes and "
       "*_weight_scale_inv dequant scales equal to the oracle's 128x128 block quantization of the BF16 weight "
       "under the engine's declared block policy, bit for bit (partial edge blocks and non-square scale grids "
       "included).", requires=["weight_sync"])
def test_weight_sync_exact(engine, model):
    got = _synced(engine, model)
    policy = engine.scale_policy("block")
    want = _oracle_sync(model, policy)
    names = _expected_names(model)
    for name in names:
        sname = ws.scale_name(name)
        if name not in got or sname not in got:
            raise AssertionError(f"{model}: {name} is not quantized by weight sync (missing "
                                 f"{'weight' if name not in got else sname})")
        g_w, g_s = got[name], got[sname]
        if g_w.dtype != want[name].dtype or g_s.dtype != torch.float32 or g_s.shape != want[sname].shape:
            raise AssertionError(f"{model}: {name}: got {g_w.dtype} {tuple(g_w.shape)} + scale {g_s.dtype} "
                                 f"{tuple(g_s.shape)}, expected {want[name].dtype} + float32 "
                                 f"{tuple(want[sname].shape)}")
        assert_tensors_equal(g_s, want[sname], context=f"{model}: {sname} ({policy.name})")
        assert_codes_equal(g_w.contiguous().view(torch.uint8).reshape(-1, g_w.shape[-1]),
                           want[name].view(torch.uint8).reshape(-1, g_w.shape[-1]), policy.fmt,
                           context=f"{model}: {name} codes ({policy.name})",
                           inputs=fixtures.tiny_model(model).state_dict[name].float().reshape(-1, g_w.shape[-1]))


@SYNC_MODELS
@check("WSYNC-NAMES-001", "The synced state dict has exactly the checkpoint's names plus one '<name>_scale_inv' "
       "per quantized weight; FP8 weights are torch.float8_e4m3fn of the weight's shape and every scale is "
       "float32 of shape (ceil(N/128), ceil(K/128)).", requires=["weight_sync"])
def test_weight_sync_names_and_shapes_exact(engine, model):
    sd = fixtures.tiny_model(model).state_dict
    got = _synced(engine, model)
    names = _expected_names(model)
    want_keys = set(sd) | {ws.scale_name(n) for n in names}
    missing, extra = sorted(want_keys - set(got)), sorted(set(got) - want_keys)
    assert not missing and not extra, f"{model}: names differ: missing {missing[:6]}, unexpected {extra[:6]}"
    g = Granularity.block(128)
    problems = []
    for n in names:
        w, s = got[n], got[ws.scale_name(n)]
        shape = tuple(sd[n].shape)  # packed experts (E, N, K): one (ceil(N/128), ceil(K/128)) grid per expert
        want_s = shape[:-2] + tuple(g.scale_shape(shape[-2:]))
        if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != tuple(sd[n].shape):
            problems.append(f"{n}: {w.dtype} {tuple(w.shape)}, expected torch.float8_e4m3fn {tuple(sd[n].shape)}")
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(want_s):
            problems.append(f"{ws.scale_name(n)}: {s.dtype} {tuple(s.shape)}, expected torch.float32 {want_s}")
    assert not problems, f"{model}: {len(problems)} tensors with wrong dtype/shape: " + "; ".join(problems[:6])


@SYNC_MODELS
@check("WSYNC-EXCL-001", "Embeddings, lm_head, every norm (incl. QK-norm), biases, the MoE router mlp.gate and the "
       "shared-expert gate are shipped unchanged in BF16 (bit-identical to the trainer's weights) and get no scale: "
       "quantizing the router, the shared-expert gate or lm_head fails.", requires=["weight_sync"])
def test_weight_sync_keeps_bf16_exact(engine, model):
    sd = fixtures.tiny_model(model).state_dict
    got = _synced(engine, model)
    kept = {n: why for n in sd for pat, why in KEEP_BF16.items() if re.search(pat, n)}
    assert any("router" in why for why in kept.values()) or not fixtures.tiny_model(model).is_moe
    bad = []
    for n, why in sorted(kept.items()):
        t = got.get(n)
        if t is None:
            bad.append(f"{n} ({why}): missing")
        elif ws.scale_name(n) in got or t.dtype != torch.bfloat16:
            bad.append(f"{n} ({why}): shipped as {t.dtype}" + (" with a scale" if ws.scale_name(n) in got else "")
                       + ", must stay BF16")
        elif t.shape != sd[n].shape or not torch.equal(t.view(torch.int16), sd[n].view(torch.int16)):
            bad.append(f"{n} ({why}): BF16 values changed")
    assert not bad, f"{model}: {len(bad)} tensors that must stay BF16 do not: " + "; ".join(bad[:6])


@SYNC_MODELS
@check("WSYNC-BOUND-001", "Whatever the declared policy, each dequantized synced weight (fp8 · block scale) is "
       "within the quantization round-trip bound of the BF16 weight.", bound="quant_roundtrip",
       requires=["weight_sync"])
def test_weight_sync_dequant_bound(engine, model):
    sd = fixtures.tiny_model(model).state_dict
    got = _synced(engine, model)
    g = Granularity.block(128)
    try:
        qts = ws.synced_tensors(got, (128, 128))
    except ValueError as exc:
        raise AssertionError(f"{model}: synced tensors are not FP8 + 128x128 block scales: {exc}") from None
    for name, qt in qts.items():
        src = ws.source_tensor(sd, name)  # a packed expert's slice for name[e]
        if src is None:
            continue
        x = src.float()
        scale_full = qt.expanded_scale()
        bound = tolerances.quant_roundtrip_bound(x.abs(), scale_full, qt.fmt)
        assert_within_bound(qt.dequantize(torch.float64), x, bound, context=f"{model}: {name} ({g.label})")


def _diff_synced(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Per tensor of ``want``: dtype, shape, then bytes (the first differing element's codes)."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        return [f"names differ: missing {missing[:4]}, unexpected {extra[:4]}"]
    bad = []
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            bad.append(f"{name}: {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}")
            continue
        gb = g.contiguous().view(torch.uint8).reshape(w.numel(), -1) if w.numel() else g
        wb = w.contiguous().view(torch.uint8).reshape(w.numel(), -1) if w.numel() else w
        if not torch.equal(gb, wb):
            diff = (gb != wb).any(-1)
            i = int(diff.nonzero()[0])
            bad.append(f"{name}: {int(diff.sum())}/{w.numel()} elements differ, first at flat index {i}: "
                       f"bytes {gb[i].tolist()} vs {wb[i].tolist()}")
    return bad


@SYNC_MODELS
@check("WSYNC-MASTER-001", "The trainer's fp32 master weights sync exactly like their BF16 cast: weight_sync of the "
       "fp32 state dict equals weight_sync of its round-to-nearest-even BF16 cast bit for bit (names, dtypes, "
       "shapes, FP8 codes, scales and the BF16 tensors kept as they are), so the rollout runs the policy the "
       "trainer's BF16 forward computes.", requires=["weight_sync"])
def test_weight_sync_fp32_master_exact(engine, model):
    _require_families(engine, model)
    master = fixtures.master_state_dict(model)
    got = engine.weight_sync({k: v.clone() for k, v in master.items()})
    want = engine.weight_sync({k: v.to(torch.bfloat16) for k, v in master.items()})
    bad = _diff_synced(got, want)
    assert not bad, f"{model}: {len(bad)} tensors of the fp32 master sync differ from the BF16 cast's: " + \
        "; ".join(bad[:6])


# ---- microscaling recipes: mxfp8 (every projection) and nvfp4-experts (routed experts only) -------------------------
# (fp8rl.reference.mx_weight_sync, docs/microscaling.md "Weight sync")

MX_SYNC = pytest.mark.parametrize("recipe", list(mxws.MX_SYNC_RECIPES))


@functools.lru_cache(maxsize=16)
def _mx_oracle_sync(model: str, recipe: str, policy: mx.MXPolicy) -> dict[str, torch.Tensor]:
    return mxws.mx_sync_state_dict(fixtures.tiny_model(model).state_dict, recipe, policy)


@MODELS
@MX_SYNC
@check("WSYNC-MX-001", "Under the microscaling rollout recipes (mxfp8: every projection MXFP8 e4m3 with E8M0 "
       "scales per 32; nvfp4-experts: only the routed experts' projections NVFP4) the synced state dict has exactly "
       "compressed-tensors' names, dtypes and shapes (<p>.weight float8_e4m3fn + <p>.weight_scale uint8 "
       "(N, ⌈K/32⌉); <p>.weight_packed uint8 (N, ⌈K/2⌉) + <p>.weight_scale float8_e4m3fn (N, ⌈K/16⌉) + "
       "<p>.weight_global_scale float32 (1,)); element bytes, scale codes and global scales equal the oracle's "
       "under the engine's declared mx_policy, and every other tensor (attention and shared expert under "
       "nvfp4-experts, router, embeddings, lm_head, norms, biases) is the trainer's BF16 tensor unchanged.",
       requires=["mx_weight_sync.{recipe}"])
def test_mx_weight_sync_exact(engine, model, recipe):
    policy = engine.mx_policy(mxws.get_mx_sync_recipe(recipe).mx_recipe)
    got = engine.mx_weight_sync(fixtures.tiny_model(model).state_dict, recipe)
    want = _mx_oracle_sync(model, recipe, policy)
    bad = _diff_synced(got, want)
    assert not bad, f"{model} {recipe} ({policy.name}): {len(bad)} synced tensors differ from the oracle's: " + \
        "; ".join(bad[:5])


@MODELS
@MX_SYNC
@check("WSYNC-MX-002", "The trainer's fp32 master weights sync under a microscaling recipe exactly like their "
       "round-to-nearest-even BF16 cast (names, dtypes, shapes, element bytes, scales, global scales, kept BF16 "
       "tensors): a quantizer reading the fp32 values directly gives other block amaxes, scales and codes.",
       requires=["mx_weight_sync.{recipe}"])
def test_mx_weight_sync_fp32_master_exact(engine, model, recipe):
    master = fixtures.master_state_dict(model)
    got = engine.mx_weight_sync({k: v.clone() for k, v in master.items()}, recipe)
    want = engine.mx_weight_sync({k: v.to(torch.bfloat16) for k, v in master.items()}, recipe)
    bad = _diff_synced(got, want)
    assert not bad, f"{model} {recipe}: {len(bad)} tensors of the fp32 master sync differ from the BF16 cast's: " + \
        "; ".join(bad[:5])


@MODELS
@MX_SYNC
@check("WSYNC-MX-003", "Whatever the declared policy, each microscaled synced weight, decoded by the format "
       "definitions (E4M3 × 2^(E8M0 − 127); E2M1 × E4M3 scale / global scale), is within the microscaling "
       "round-trip bound of the BF16 weight.", bound="mx_roundtrip", requires=["mx_weight_sync.{recipe}"])
def test_mx_weight_sync_dequant_bound(engine, model, recipe):
    sd = fixtures.tiny_model(model).state_dict
    r = mxws.get_mx_sync_recipe(recipe)
    policy = engine.mx_policy(r.mx_recipe)
    got = engine.mx_weight_sync(sd, recipe)
    names = mxws.mx_quantized_names(sd, r)
    assert names or not fixtures.tiny_model(model).is_moe or recipe != "nvfp4-experts", \
        f"{model}: nvfp4-experts quantizes no expert (the fixture has experts)"
    for name in names:
        x = sd[name].float()
        parts = mxws.mx_synced_names(name, r)
        if any(p not in got for p in parts):
            raise AssertionError(f"{model} {recipe}: {name} is not synced as {parts} "
                                 f"(missing {[p for p in parts if p not in got]})")
        data, scales = got[parts[0]].contiguous().view(torch.uint8), got[parts[1]].contiguous().view(torch.uint8)
        g = got[parts[2]].reshape(()).float() if policy.two_level else None
        q = mx.MXTensor(data, scales, g, tuple(x.shape), policy)
        try:
            deq = mx.dequantize_mx(q)
        except Exception as exc:  # noqa: BLE001 - a layout the decoder can't read is the engine's fault
            raise AssertionError(f"{model} {recipe}: {name}: the synced tensors do not decode as {policy.name} "
                                 f"({type(exc).__name__}: {exc})") from None
        assert_within_bound(deq, x, tolerances.mx_roundtrip_bound(q, x),
                            context=f"{model} {recipe}: {name} ({policy.name})")


# ---- refit: each RL step's FP8 refit into the engine's live inference model, read back -----------------------------
# (engine verl-vllm-refit: veRL's vllm_quant_utils refit into vLLM's model classes; docs/verl-vllm-refit.md)

#: how many refits with changing weights each refit check performs
REFIT_STEPS = 3
#: refits of the memory check (WSYNC-REFIT-003): the first sets the baseline, each later one must add nothing
REFIT_MEMORY_STEPS = 4


@functools.lru_cache(maxsize=16)
def _step_state_dict(model: str, step: int) -> dict[str, torch.Tensor]:
    """The trainer's BF16 weights at RL step ``step``: the fixture (0), its ``update`` variant (1), then the update
    variant with a seeded perturbation of every floating tensor — norms and biases included — (2, 3, ...), so that
    every tensor, quantized or kept in BF16, changes from one step to another."""
    if step == 0:
        return fixtures.tiny_model(model).state_dict
    base = fixtures.tiny_model(model, "update").state_dict
    if step == 1:
        return base
    g = torch.Generator().manual_seed(7919 * step + 17)
    out = {}
    for n, t in base.items():
        if not t.is_floating_point():
            out[n] = t
            continue
        x = t.float()
        out[n] = (x + (0.25 * x.abs().mean() + 1e-3) * torch.randn(x.shape, generator=g)).to(torch.bfloat16)
    return out


def _refit_problems(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                    before: dict[str, torch.Tensor] | None) -> list[str]:
    """:func:`_diff_synced`, each differing tensor classified: silently cast (a BF16 tensor where FP8 codes are
    due, or the reverse), stale (equal to the previous step's expected tensor), or wrong."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    out = []
    if missing:
        out.append(f"missing {len(missing)}: {missing[:4]}")
    if extra:
        out.append(f"unexpected {len(extra)}: {extra[:4]}")
    for line in _diff_synced({k: got[k] for k in want if k in got}, {k: w for k, w in want.items() if k in got}):
        name = line.split(":", 1)[0]
        g, w = got.get(name), want.get(name)
        if g is not None and w is not None and g.dtype != w.dtype:
            line = f"{line} (silently cast: {g.dtype} held where {w.dtype} is due)"
        elif before is not None and name in before and g is not None and g.dtype == before[name].dtype and \
                g.shape == before[name].shape and torch.equal(g.contiguous().view(torch.uint8),
                                                              before[name].contiguous().view(torch.uint8)):
            line = f"{line} (stale: the previous step's value)"
        out.append(line)
    return out


@SYNC_MODELS
@check("WSYNC-REFIT-001", "After each of 3 refits with changing weights, every parameter the engine's live model "
       "holds, read back in the layout its kernels consume (FP8 codes, *_weight_scale_inv scales, BF16 leftovers), "
       "equals the oracle's weight sync of that step's BF16 weights under the engine's declared block policy, bit "
       "for bit: the quantized set is exactly the projections (embeddings, lm_head, norms, biases, router and "
       "shared-expert gate stay BF16), none stale, none silently cast, none missing, none extra.",
       requires=["weight_sync.refit"])
def test_refit_steps_exact(engine, model):
    _require_families(engine, model)
    config = fixtures.tiny_model(model).config
    recipe = ws.WeightSyncRecipe(policy=engine.scale_policy("block"))
    before = None
    for step in range(REFIT_STEPS):
        sd = _step_state_dict(model, step)
        got = engine.refit(config, sd)
        want = ws.quantize_state_dict(sd, recipe)
        bad = _refit_problems(got, want, before)
        assert not bad, (f"{model}: after refit {step + 1}/{REFIT_STEPS}, {len(bad)} parameters of the live model "
                         f"differ from the oracle's sync of that step's weights ({recipe.policy.name}): "
                         + "; ".join(bad[:6]))
        before = want


@SYNC_MODELS
@check("WSYNC-REFIT-002", "A refit that fails (a weight of the wrong shape in the middle of the step's stream) "
       "raises, and the live model still holds the previous step's parameters bit for bit: no tensor of the failed "
       "step is left behind (a half-updated policy).", requires=["weight_sync.refit"])
def test_refit_failure_atomic_exact(engine, model):
    from fp8rl.engine import EngineError

    _require_families(engine, model)
    config = fixtures.tiny_model(model).config
    recipe = ws.WeightSyncRecipe(policy=engine.scale_policy("block"))
    prev = _step_state_dict(model, 0)
    engine.refit(config, prev)
    bad_sd = dict(_step_state_dict(model, 1))
    names = ws.quantized_names(bad_sd)
    victim = names[len(names) // 2]  # mid-stream: the tensors before it are valid
    bad_sd[victim] = bad_sd[victim][:-1].clone()
    with pytest.raises(EngineError):
        engine.refit(config, bad_sd)
    after = engine.refit(config, None)
    want = ws.quantize_state_dict(prev, recipe)
    bad = _refit_problems(after, want, None)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    stepped = [n for n, t in ws.quantize_state_dict(bad_sd, recipe).items()
               if n in after and n in want and same(after[n], t) and not same(after[n], want[n])]
    assert not bad, (f"{model}: after a refit that failed at {victim} (one row short), {len(bad)} parameters differ "
                     f"from the previous step's; {len(stepped)} hold the failed step's values (half-updated: "
                     f"{stepped[:4]}): " + "; ".join(bad[:4]))


def _held_tensor_storage() -> tuple[int, int]:
    """(bytes, count) of the distinct tensor storages alive in this process that Python reaches: every
    ``torch.Tensor`` the garbage collector tracks (parameters, buffers, module attributes, caches of any library),
    each storage counted once, meta tensors excluded. Tensors held only by C++ code are not seen."""
    gc.collect()
    seen: dict[tuple[int, int], int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no __class__ lookups on proxies
            continue
        try:
            if obj.is_meta:
                continue
            st = obj.untyped_storage()
            seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, functional wrappers)
            continue
    return sum(seen.values()), len(seen)


@SYNC_MODELS
@check("WSYNC-REFIT-003", "Across 4 refits of one live model with changing weights, the memory a refit leaves "
       "behind does not grow: once the step's weights and read-back are released, the distinct tensor storages "
       "alive in the process (every tensor Python reaches: the live model's parameters, the engine's staging "
       "buffers and caches) take no more bytes, in no more storages, after refits 2, 3 and 4 than after refit 1, "
       "exactly (a one-time release after the first refit is not growth). A refit that "
       "keeps the previous step's tensors (old parameters, staged copies, a cache keyed by step) grows by them at "
       "every RL step.", requires=["weight_sync.refit", "weight_sync.refit_memory"])
def test_refit_memory_flat_exact(engine, model):
    _require_families(engine, model)
    config = fixtures.tiny_model(model).config
    steps = [_step_state_dict(model, step) for step in range(REFIT_MEMORY_STEPS)]  # made (and cached) up front
    held = []
    for sd in steps:
        got = engine.refit(config, sd)
        del got
        held.append(_held_tensor_storage())
    base_bytes, base_count = held[0]
    grew = [f"after refit {k + 1}: {b - base_bytes:+,} bytes in {n - base_count:+} storages"
            for k, (b, n) in enumerate(held) if k and (b > base_bytes or n > base_count)]
    assert not grew, (f"{model}: the tensor memory held after a refit grows from one RL step to the next (refit 1: "
                      f"{base_bytes:,} bytes in {base_count} storages): " + "; ".join(grew))


def _step_kv_scales(state_dict: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The trainer-side KV-cache calibration pushed with RL step ``step``: for every attention layer (each
    ``<layer>.self_attn.o_proj.weight``) a ``k_scale`` and a ``v_scale``, fp32 0-d dequant scales, seeded per layer
    in [2^-8, 2^-4] and 1.5x the previous step's at every step, so that a stale scale (the previous step's) or the
    1.0 default lies far outside the one-BF16-rounding bound."""
    suffix = ".self_attn.o_proj.weight"
    layers = sorted(n[: -len(suffix)] for n in state_dict if n.endswith(suffix))
    g = torch.Generator().manual_seed(104729)
    out = {}
    for layer in layers:
        for kind in ("k", "v"):
            base = 2.0 ** (-8 + 4 * torch.rand((), generator=g, dtype=torch.float64).item())
            out[f"{layer}.self_attn.{kind}_scale"] = torch.tensor(base * 1.5 ** step, dtype=torch.float32)
    return out


@SYNC_MODELS
@check("WSYNC-REFIT-004", "With an FP8 KV cache, after each of 3 refits whose stream carries that step's KV-cache "
       "scales (the trainer-side calibration of every attention layer: <layer>.self_attn.k_scale and v_scale, fp32), "
       "the scales the live model's attention kernels read equal the pushed ones to at most one BF16 rounding: "
       "none stale (the previous step's), none left at the 1.0 default, none missing.", bound="refit_kv_scale",
       requires=["weight_sync.refit", "weight_sync.refit_kv"])
def test_refit_kv_scales_bound(engine, model):
    _require_families(engine, model)
    config = dict(fixtures.tiny_model(model).config, kv_cache_dtype="fp8_e4m3")
    tol = tolerances.get("refit_kv_scale").value
    prev: dict[str, torch.Tensor] | None = None
    for step in range(REFIT_STEPS):
        sd = _step_state_dict(model, step)
        pushed = _step_kv_scales(sd, step)
        assert pushed, f"{model}: no attention layer (no *.self_attn.o_proj.weight) to carry KV-cache scales"
        got = engine.refit(config, {**sd, **pushed})
        bad = []
        for name, s in pushed.items():
            held = got.get(name)
            if held is None or held.numel() != 1:
                bad.append(f"{name}: {'missing' if held is None else f'shape {tuple(held.shape)}'} in the read-back")
                continue
            value, want = float(held.double()), float(s)
            rel = abs(value - want) / want
            if not rel <= tol:
                why = (" (the 1.0 default)" if value == 1.0 else
                       " (stale: the previous step's)" if prev is not None and
                       abs(value - float(prev[name])) <= tol * float(prev[name]) else "")
                bad.append(f"{name}: the attention reads {value:.6g}, the step pushed {want:.6g} (relative error "
                           f"{rel:.3g} > {tol:.3g}){why}")
        assert not bad, (f"{model}: after refit {step + 1}/{REFIT_STEPS}, {len(bad)} of {len(pushed)} KV-cache scales "
                         "are not the step's: " + "; ".join(bad[:4]))
        prev = pushed
