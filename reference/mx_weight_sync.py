"""Weight sync for the microscaling rollout recipes: BF16 trainer weights → the MXFP8 / NVFP4 tensors a rollout
engine loads each RL step (docs/microscaling.md, "Weight sync").

Recipes (:data:`MX_SYNC_RECIPES`), as the RL frameworks run them (NeMo-RL's MXFP8 rollout on vLLM, NVFP4 MoE
rollout; veRL's MXFP8 and NVFP4 rollout PRs):

* ``mxfp8``: every projection the FP8 sync quantizes (attention q/k/v/o, MLP gate/up/down, each routed expert's and a
  shared expert's; :data:`fp8rl.reference.weight_sync.DEFAULT_INCLUDE` minus ``DEFAULT_EXCLUDE``) → MXFP8 E4M3 with
  one E8M0 scale per 1×32 block along K (the input dimension), the OCP floor rule unless the engine declares another
  ``mx_policy("mxfp8_e4m3")``.
* ``nvfp4-experts``: only the routed MoE experts' projections (``mlp.experts.<e>.{gate,up,down}_proj.weight``) →
  NVFP4 (E2M1 packed two per byte, one E4M3 scale per 1×16 block, one fp32 global scale per weight); everything
  else stays BF16 — attention, dense MLPs, a shared expert and its gate, the router, embeddings, lm_head, norms.

Names, dtypes and shapes follow the compressed-tensors checkpoint layout, which vLLM's compressed-tensors schemes
load (vllm-project/vllm ``compressed_tensors_w8a8_mxfp8.py``, ``compressed_tensors_w4a4_nvfp4.py``, v0.32.0). For a
quantized ``<p>.weight`` of shape (N, K):

* MXFP8: ``<p>.weight`` → ``torch.float8_e4m3fn`` (N, K); ``<p>.weight_scale`` → ``torch.uint8`` E8M0 codes
  (N, ⌈K/32⌉); W ≈ e4m3 · 2^(code − 127).
* NVFP4: ``<p>.weight_packed`` → ``torch.uint8`` (N, ⌈K/2⌉), element 2i in the low nibble; ``<p>.weight_scale`` →
  ``torch.float8_e4m3fn`` (N, ⌈K/16⌉); ``<p>.weight_global_scale`` → ``torch.float32`` (1,) holding g = 448·6/amax;
  W ≈ e2m1 · s / g.

Every other tensor is shipped as its BF16 cast. Quantized weights are cast to BF16 first (as the FP8 sync does), so
the trainer's fp32 master weights sync exactly like their BF16 cast.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
from fp8rl.reference import microscaling as mx
from fp8rl.reference.weight_sync import DEFAULT_EXCLUDE, DEFAULT_INCLUDE

__all__ = ["MX_SYNC_RECIPES", "MXSyncRecipe", "get_mx_sync_recipe", "mx_quantized_names", "mx_sync_state_dict",
           "mx_synced_names"]

#: the routed experts' projections (not a shared expert's: ``mlp.shared_expert.*``)
EXPERT_INCLUDE: tuple[str, ...] = (r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$",)


class MXSyncRecipe:
    """One microscaling weight-sync recipe: which weights are quantized and under which MX recipe
    (:data:`fp8rl.reference.microscaling.RECIPES` key)."""

    def __init__(self, name: str, mx_recipe: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> None:
        self.name, self.mx_recipe, self.include, self.exclude = name, mx_recipe, include, exclude

    def quantizes(self, name: str, shape: tuple[int, ...]) -> bool:
        """2-D, matches ``include`` and no ``exclude`` pattern (``re.search``)."""
        return len(shape) == 2 and not any(re.search(p, name) for p in self.exclude) and \
            any(re.search(p, name) for p in self.include)

    def __repr__(self) -> str:
        return f"MXSyncRecipe({self.name!r}, mx_recipe={self.mx_recipe!r})"


#: recipe name → recipe
MX_SYNC_RECIPES: dict[str, MXSyncRecipe] = {r.name: r for r in (
    MXSyncRecipe("mxfp8", "mxfp8_e4m3", DEFAULT_INCLUDE, DEFAULT_EXCLUDE),
    MXSyncRecipe("nvfp4-experts", "nvfp4", EXPERT_INCLUDE, DEFAULT_EXCLUDE),
)}


def get_mx_sync_recipe(name: str) -> MXSyncRecipe:
    try:
        return MX_SYNC_RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"recipe: expected one of {sorted(MX_SYNC_RECIPES)}, got {name!r}") from None


def _prefix(name: str) -> str:
    """``…q_proj.weight`` → ``…q_proj`` (the module whose ``weight*`` tensors the sync writes)."""
    return name[: -len(".weight")]


def mx_synced_names(name: str, recipe: str | MXSyncRecipe) -> tuple[str, ...]:
    """The names a quantized ``name`` becomes: MXFP8 (weight, weight_scale); NVFP4 (weight_packed, weight_scale,
    weight_global_scale)."""
    r = recipe if isinstance(recipe, MXSyncRecipe) else get_mx_sync_recipe(recipe)
    p = _prefix(name)
    if mx.get_mx_policy(r.mx_recipe).two_level:
        return (f"{p}.weight_packed", f"{p}.weight_scale", f"{p}.weight_global_scale")
    return (f"{p}.weight", f"{p}.weight_scale")


def mx_quantized_names(state_dict: Mapping[str, torch.Tensor], recipe: str | MXSyncRecipe) -> list[str]:
    """The names :func:`mx_sync_state_dict` quantizes, in input order."""
    r = recipe if isinstance(recipe, MXSyncRecipe) else get_mx_sync_recipe(recipe)
    return [n for n, t in state_dict.items() if r.quantizes(n, tuple(t.shape))]


def mx_sync_state_dict(state_dict: Mapping[str, torch.Tensor], recipe: str | MXSyncRecipe,
                       policy: str | mx.MXPolicy | None = None,
                       quantize_fn: Callable[[torch.Tensor], mx.MXTensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors a microscaling weight sync ships (names and layout: the module docstring).

    ``policy``: the MX policy of the quantizer (default: the oracle's for the recipe's format); ``quantize_fn(w)``:
    the quantizer of one BF16 weight (default: :func:`fp8rl.reference.microscaling.mx_quantize` under ``policy``).
    Returns a new dict in input order, each quantized weight's tensors in place of it.
    """
    r = recipe if isinstance(recipe, MXSyncRecipe) else get_mx_sync_recipe(recipe)
    pol = mx.get_mx_policy(policy if policy is not None else r.mx_recipe)
    qfn = quantize_fn or (lambda w: mx.mx_quantize(w, pol))
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
        if not r.quantizes(name, tuple(t.shape)):
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() and t.dtype != torch.bfloat16 else t
            continue
        # the BF16 cast first (fp32 masters sync like their BF16 cast); the quantizer reads the BF16 values
        q = qfn(t.detach().to("cpu", torch.bfloat16).float())
        names = mx_synced_names(name, r)
        if pol.two_level:
            out[names[0]] = q.data.contiguous()
            out[names[1]] = q.scales.contiguous().view(torch.float8_e4m3fn)
            out[names[2]] = torch.as_tensor(q.global_scale, dtype=torch.float32).reshape(1).clone()
        else:
            out[names[0]] = q.data.contiguous().view(torch.float8_e4m3fn)
            out[names[1]] = q.scales.contiguous()
    return out
