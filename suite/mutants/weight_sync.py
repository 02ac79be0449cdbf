"""Weight-sync mutants: the per-step BF16 → FP8 weight sync with one realistic bug each (area ``weight_sync``:
the synced checkpoint is wrong), FP8 and microscaling (MXFP8, NVFP4) recipes."""

from __future__ import annotations

import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import microscaling as mx
from fp8rl.reference import mx_weight_sync as mxws

from ._base import mutant
from .quantization import _nvfp4_with_global

_ROUTER = r"(^|\.)mlp\.gate\.weight$"


@mutant("wsync-router-quantized", "weight sync quantizes the MoE router mlp.gate to FP8 (it must stay BF16; "
        "the name filter lost its router exclusion)", kills=("WSYNC-EXCL-001", "WSYNC-NAMES-001"))
class RouterQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(exclude=tuple(p for p in r.exclude if p != _ROUTER), include=r.include + (_ROUTER,))


@mutant("wsync-lm-head-quantized", "weight sync quantizes lm_head to FP8 (it must stay BF16: its logits feed "
        "sampling directly)", kills=("WSYNC-EXCL-001", "WSYNC-NAMES-001"))
class LmHeadQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        head = r"(^|\.)lm_head\."
        return r.with_(exclude=tuple(p for p in r.exclude if p != head), include=r.include + (r"(^|\.)lm_head\.weight$",))


@mutant("wsync-scale-inverse", "weight sync stores the quant multiplier 1/s as *_weight_scale_inv (the name read "
        "literally) instead of the dequant scale s", kills=("WSYNC-BOUND-001", "WSYNC-EXACT-001"))
class ScaleStoredInverse(ReferenceEngine):
    def weight_sync(self, state_dict):
        out = super().weight_sync(state_dict)
        return {k: (1.0 / v.double()).float() if k.endswith("_scale_inv") else v for k, v in out.items()}


@mutant("wsync-block-grid-transposed", "weight sync writes a non-square weight's 128x128 scale grid column-major "
        "into a row-major (ceil(N/128), ceil(K/128)) tensor", kills=("WSYNC-BOUND-001", "WSYNC-EXACT-001"))
class SyncBlockGridTransposed(ReferenceEngine):
    def weight_sync(self, state_dict):
        out = super().weight_sync(state_dict)
        for k, v in out.items():
            if k.endswith("_scale_inv") and v.dim() == 2 and v.shape[0] != v.shape[1]:
                out[k] = v.t().contiguous().reshape(v.shape)
        return out


@mutant("wsync-fp32-direct", "weight sync quantizes the trainer's fp32 master weights directly instead of casting "
        "them to BF16 first (block amax and rounding taken from the fp32 values; the rest still shipped in BF16)",
        kills=("WSYNC-MASTER-001",))
class SyncFP32Direct(ReferenceEngine):
    def weight_sync(self, state_dict):
        import torch
        from fp8rl.reference import weight_sync as ws

        out = ws.quantize_state_dict(state_dict, self._weight_sync_recipe().with_(cast_dtype=torch.float32))
        return {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.endswith(ws.SCALE_SUFFIX) else v
                for k, v in out.items()}


@mutant("wsync-shared-gate-quantized", "weight sync quantizes the shared-expert gate mlp.shared_expert_gate (a "
        "name filter that takes every 2-D 'mlp' weight but the router: it must stay BF16)",
        kills=("WSYNC-EXCL-001", "WSYNC-NAMES-001"))
class SharedGateQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(exclude=tuple(p for p in r.exclude if "shared_expert_gate" not in p),
                       include=r.include + (r"(^|\.)mlp\.shared_expert_gate\.weight$",))


@mutant("wsync-shared-expert-skipped", "weight sync's name filter knows the dense MLP and the routed experts only "
        "(mlp.(gate|up|down)_proj, mlp.experts.<e>.*): the shared expert's projections ship in BF16 and the rollout "
        "runs them unquantized", kills=("WSYNC-EXACT-001", "WSYNC-NAMES-001"))
class SharedExpertSkipped(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(include=(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$",
                                r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$",
                                r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$"))


# ---- architecture families beyond Qwen (fixtures.FAMILY_MODELS) ----------------------------------------------------

@mutant("wsync-mla-skipped", "weight sync's name filter knows the GQA projections only (q/k/v/o_proj): DeepSeek's "
        "MLA projections q_a_proj, q_b_proj, kv_a_proj_with_mqa and kv_b_proj ship in BF16 and the rollout runs "
        "them unquantized", kills=("WSYNC-EXACT-001", "WSYNC-NAMES-001"))
class MLASkipped(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(include=tuple(p for p in r.include if "kv_b_proj" not in p))


@mutant("wsync-packed-experts-skipped", "weight sync's name filter takes '.weight' parameters only: the MoE experts "
        "a transformers-5 trainer holds packed (mlp.experts.gate_up_proj / down_proj, no '.weight' suffix) ship in "
        "BF16", kills=("WSYNC-EXACT-001", "WSYNC-NAMES-001"))
class PackedExpertsSkipped(ReferenceEngine):
    def _weight_sync_recipe(self):
        from fp8rl.reference import weight_sync as ws

        r = super()._weight_sync_recipe()
        return r.with_(include=tuple(p for p in r.include if p != ws.PACKED_EXPERTS))


@mutant("wsync-packed-experts-flattened", "weight sync quantizes a packed (E, N, K) expert tensor as one 2-D "
        "(E*N, K) matrix: 128-row blocks straddle two experts where N is not a multiple of 128, and the scales come "
        "out (ceil(E*N/128), ceil(K/128)) instead of one grid per expert",
        kills=("WSYNC-BOUND-001", "WSYNC-EXACT-001", "WSYNC-NAMES-001"))
class PackedExpertsFlattened(ReferenceEngine):
    def weight_sync(self, state_dict):
        from fp8rl.reference import weight_sync as ws

        flat = {k: v.reshape(-1, v.shape[-1]) if ws.is_packed_experts(k, tuple(v.shape)) else v
                for k, v in state_dict.items()}
        out = ws.quantize_state_dict(flat, self._weight_sync_recipe())  # a 2-D '.experts.gate_up_proj' still matches
        return {k: v.reshape(state_dict[k].shape) if k in state_dict and v.shape != state_dict[k].shape else v
                for k, v in out.items()}


@mutant("wsync-vision-quantized", "weight sync's name filter matches projection names anywhere: a multimodal "
        "model's vision tower (model.visual.blocks.*.mlp.gate_proj/up_proj/down_proj) is quantized too (it must "
        "stay BF16)", kills=("WSYNC-EXCL-001", "WSYNC-NAMES-001"))
class VisionQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(exclude=tuple(p for p in r.exclude if "visual" not in p))


@mutant("wsync-anchored-filter", "weight sync's name filter is anchored at the text model's module path "
        "(^model\\.layers\\.): a multimodal wrapper's language model under model.language_model.layers. ships "
        "entirely in BF16", kills=("WSYNC-EXACT-001", "WSYNC-NAMES-001"))
class AnchoredFilter(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(include=tuple(r"^model\.layers\.\d+.*" + p for p in r.include))


# ---- microscaling recipes (fp8rl.reference.mx_weight_sync) ----------------------------------------------------------

def _mx_sync(engine: ReferenceEngine, state_dict, recipe: str, **recipe_changes):
    """The oracle's MX sync under the engine's policy, with a changed recipe (name filter)."""
    r = mxws.get_mx_sync_recipe(recipe)
    r = mxws.MXSyncRecipe(r.name, r.mx_recipe, recipe_changes.get("include", r.include),
                          recipe_changes.get("exclude", r.exclude))
    return mxws.mx_sync_state_dict(state_dict, r, engine.mx_policy(r.mx_recipe))


@mutant("mx-sync-fp32-direct", "the microscaling weight sync quantizes the trainer's fp32 master weights directly "
        "(no BF16 cast first): other block amaxes, E8M0/E4M3 scales and codes than the BF16 policy's",
        kills=("WSYNC-MX-002",))
class MXSyncFp32Direct(ReferenceEngine):
    def mx_weight_sync(self, state_dict, recipe):
        r = mxws.get_mx_sync_recipe(recipe)
        p = self.mx_policy(r.mx_recipe)
        out = super().mx_weight_sync(state_dict, recipe)
        for name in mxws.mx_quantized_names(state_dict, r):
            q = mx.mx_quantize(state_dict[name].detach().float(), p)
            parts = mxws.mx_synced_names(name, r)
            if p.two_level:
                out[parts[0]], out[parts[1]] = q.data, q.scales.view(torch.float8_e4m3fn)
                out[parts[2]] = q.global_scale.reshape(1).float()
            else:
                out[parts[0]], out[parts[1]] = q.data.view(torch.float8_e4m3fn), q.scales
        return out


@mutant("nvfp4-sync-attention-quantized", "nvfp4-experts syncs the attention projections in NVFP4 too (a name "
        "filter that matches every projection of an MoE layer, not the routed experts only)",
        kills=("WSYNC-MX-001",))
class NVFP4SyncAttention(ReferenceEngine):
    def mx_weight_sync(self, state_dict, recipe):
        if recipe != "nvfp4-experts":
            return super().mx_weight_sync(state_dict, recipe)
        return _mx_sync(self, state_dict, recipe, include=mxws.EXPERT_INCLUDE + (r"\.(q_proj|k_proj|v_proj|o_proj)"
                                                                                   r"\.weight$",))


@mutant("nvfp4-sync-global-inverted", "NVFP4 sync stores the dequant-direction global scale 1/g (amax/2688) as "
        "weight_global_scale, where compressed-tensors and vLLM store g = 2688/amax",
        kills=("WSYNC-MX-001", "WSYNC-MX-003"))
class NVFP4SyncGlobalInverted(ReferenceEngine):
    def mx_weight_sync(self, state_dict, recipe):
        out = super().mx_weight_sync(state_dict, recipe)
        return {k: (1.0 / v.double()).float() if k.endswith(".weight_global_scale") else v for k, v in out.items()}


@mutant("nvfp4-sync-gate-up-one-global", "NVFP4 sync quantizes an expert's up_proj with its gate_proj's global "
        "scale (one global scale for the fused w13 GEMM, taken from the first shard)", kills=("WSYNC-MX-001",))
class NVFP4SyncSharedGlobal(ReferenceEngine):
    def mx_weight_sync(self, state_dict, recipe):
        out = super().mx_weight_sync(state_dict, recipe)
        r = mxws.get_mx_sync_recipe(recipe)
        p = self.mx_policy(r.mx_recipe)
        if not p.two_level:
            return out
        for name in mxws.mx_quantized_names(state_dict, r):
            if ".up_proj." not in name:
                continue
            gate = state_dict[name.replace(".up_proj.", ".gate_proj.")].detach().to(torch.bfloat16).float()
            g = mx.nvfp4_global_scale(gate, p.global_op)
            q = _nvfp4_with_global(state_dict[name].detach().to(torch.bfloat16).float(), p, g)
            parts = mxws.mx_synced_names(name, r)
            out[parts[0]], out[parts[1]] = q.data, q.scales.view(torch.float8_e4m3fn)
            out[parts[2]] = g.reshape(1).float()
        return out


@mutant("mxfp8-sync-scales-along-n", "MXFP8 sync computes the E8M0 blocks along the output dimension N (the "
        "weight's columns) instead of along K, the reduction dimension the GEMM reads them on",
        kills=("WSYNC-MX-001", "WSYNC-MX-003"))
class MXFP8SyncScalesAlongN(ReferenceEngine):
    def mx_weight_sync(self, state_dict, recipe):
        r = mxws.get_mx_sync_recipe(recipe)
        p = self.mx_policy(r.mx_recipe)
        if p.two_level:
            return super().mx_weight_sync(state_dict, recipe)
        out = super().mx_weight_sync(state_dict, recipe)
        for name in mxws.mx_quantized_names(state_dict, r):
            q = mx.mx_quantize(state_dict[name].detach().to(torch.bfloat16).float().T.contiguous(), p)
            codes, scales = q.data.T.contiguous(), q.scales.T.contiguous()
            parts = mxws.mx_synced_names(name, r)
            out[parts[0]] = codes.view(torch.float8_e4m3fn)
            # the scale tensor keeps the expected (N, ⌈K/32⌉) shape where it can: the values are per-N blocks
            n, k = state_dict[name].shape
            want = (n, -(-k // p.block))
            out[parts[1]] = scales.reshape(-1)[: want[0] * want[1]].reshape(want) \
                if scales.numel() >= want[0] * want[1] else scales
        return out
