"""The production forward as one registered custom op, as vLLM ships its MoE layer.

`torch.ops.moe_verify.fused_moe` is registered through `torch.library` with a fake (meta)
implementation for tracing and torch.compile, `workspace` declared as the one argument it
mutates, and the `needs_exact_strides` tag, so Inductor hands every tensor over with the
strides eager mode would (vLLM #49928: Inductor rewrote a TMA-aligned scale's strides, and the
kernel read out of bounds). `needs_fixed_stride_order`, vLLM's default, keeps only the order: an
MN-major scale built in the graph loses its TMA padding (tests/optimized/test_op.py). The real
implementation is `ProductionForward.forward`: no host syncs (the exact-count path reads the
counts once), workspaces sized for the token bound, DeepGEMM's alignment scope set inside the op.

Which forward runs is a registered name (`register_forward`), so a kernel developer's subclass,
or a deliberately wrong one, runs under capture and compile exactly as ours does. `recording`
collects the stage outputs of every call made inside it (the taps of a CUDA-graph capture).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from moe_verify.spec import Activation, Engine, QuantizedWeight, Recipe, ScaleFmt
from optimized.production import (
    ForwardConfig,
    ProductionForward,
    RankWeights,
    Taps,
)

OP_NAME = "moe_verify::fused_moe"

_FORWARDS: dict[str, ProductionForward] = {}
_sinks: list[Taps] = []


def register_forward(forward: ProductionForward) -> str:
    """Make `forward` callable through the op under its `name` (replacing one of that name)."""
    if not isinstance(forward, ProductionForward):
        raise TypeError(f"register_forward: expected a ProductionForward, got {forward!r}")
    _FORWARDS[forward.name] = forward
    return forward.name


def registered_forward(name: str) -> ProductionForward:
    try:
        return _FORWARDS[name]
    except KeyError:
        raise ValueError(
            f"{OP_NAME}: no production forward named {name!r} is registered (known: "
            f"{sorted(_FORWARDS)}); register it with optimized.op.register_forward"
        ) from None


register_forward(ProductionForward())


@contextlib.contextmanager
def recording(taps: Taps) -> Iterator[Taps]:
    """Inside this block, the op's real implementation puts each stage's outputs in `taps`
    (the last call's win). Tensors allocated during a CUDA-graph capture stay graph-resident."""
    _sinks.append(taps)
    try:
        yield taps
    finally:
        _sinks.pop()


@functools.lru_cache(maxsize=256)
def _config(
    recipe: str,
    scale_fmt: str,
    activation: str,
    alpha: float,
    beta: float,
    limit: float | None,
    alignment: int,
    layout: str,
    engine: str,
    num_local_experts: int,
    hidden: int,
    intermediate: int,
    topk: int,
    exact_m_sum: bool,
    ll_max_tokens: int,
) -> ForwardConfig:
    return ForwardConfig(
        recipe=Recipe(recipe),
        scale_fmt=ScaleFmt(scale_fmt),
        activation=Activation(activation, alpha, beta, limit),
        alignment=alignment,
        layout=layout,
        engine=Engine(engine),
        num_local_experts=num_local_experts,
        hidden=hidden,
        intermediate=intermediate,
        topk=topk,
        exact_m_sum=exact_m_sum,
        ll_max_tokens=ll_max_tokens,
    )


def _shapes(
    hidden_states: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor
) -> tuple[int, int, int, int]:
    """(E_l, H, I, k) read from the tensors' shapes (E2M1 weights hold two codes a byte)."""
    e_l, two_i, _ = w13.shape
    return e_l, hidden_states.shape[1], two_i // 2, topk_ids.shape[1]


@torch.library.custom_op(
    OP_NAME, mutates_args=("workspace",), tags=(torch.Tag.needs_exact_strides,)
)
def fused_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    expert_map: torch.Tensor | None,
    workspace: torch.Tensor,
    recipe: str,
    scale_fmt: str,
    activation: str,
    alpha: float,
    beta: float,
    limit: float | None,
    alignment: int,
    layout: str,
    engine: str,
    ll_max_tokens: int,
    exact_m_sum: bool,
    forward: str,
) -> torch.Tensor:
    """One rank's routed-expert MoE forward: out bf16 [T, H].

    hidden_states bf16 [T, H]; topk_ids [T, k] signed global ids (-1 = none; ids outside the
    expert map are skipped); topk_weights fp32 [T, k]; w13 / w2 this rank's quantized experts
    with their scales in the GEMM engine's layout (`production.prepare_rank_weights`);
    expert_map int32 [E_global] or None; workspace uint8, `production.workspace_bytes` for T.
    The rest is the `ForwardConfig` (limit None: no clamp) and the registered forward's name.
    """
    e_l, h, i, k = _shapes(hidden_states, topk_ids, w13)
    cfg = _config(
        recipe, scale_fmt, activation, alpha, beta, limit, alignment, layout, engine,
        e_l, h, i, k, exact_m_sum, ll_max_tokens,
    )  # fmt: skip
    block = cfg.recipe.weight_block
    weights = RankWeights(
        QuantizedWeight(w13, w13_scale, block),
        QuantizedWeight(w2, w2_scale, block),
        w13_scale,
        w2_scale,
        expert_map,
    )
    taps = _sinks[-1] if _sinks else None
    if taps is not None:
        taps.clear()
    fwd = registered_forward(forward)
    return fwd.forward(cfg, hidden_states, topk_ids, topk_weights, weights, workspace, taps)


@fused_moe.register_fake
def _(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    # Exactly what the real op returns: a fresh contiguous bf16 [T, H] (ep_gather's output). The
    # output depends on no other argument's shape, so the rest are taken as they come.
    return hidden_states.new_empty(hidden_states.shape, dtype=torch.bfloat16)


def op_args(cfg: ForwardConfig, forward: str = "optimized") -> dict[str, object]:
    """The op's non-tensor arguments for `cfg`."""
    act = cfg.activation
    return {
        "recipe": cfg.recipe.value,
        "scale_fmt": cfg.scale_fmt.value,
        "activation": act.kind,
        "alpha": act.alpha,
        "beta": act.beta,
        "limit": act.limit,
        "alignment": cfg.alignment,
        "layout": cfg.layout,
        "engine": cfg.engine.value,
        "ll_max_tokens": cfg.ll_max_tokens,
        "exact_m_sum": cfg.exact_m_sum,
        "forward": forward,
    }


def tensor_args(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: RankWeights,
    workspace: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    """The op's tensor arguments, in its schema's order."""
    return (
        hidden_states,
        topk_ids,
        topk_weights,
        weights.w13.q,
        weights.w13_scale,
        weights.w2.q,
        weights.w2_scale,
        weights.expert_map,
        workspace,
    )


def call(
    cfg: ForwardConfig,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: RankWeights,
    workspace: torch.Tensor,
    forward: str = "optimized",
) -> torch.Tensor:
    """`torch.ops.moe_verify.fused_moe` with `cfg` and `weights` spelled out as its arguments."""
    args = tensor_args(hidden_states, topk_ids, topk_weights, weights, workspace)
    return torch.ops.moe_verify.fused_moe(*args, **op_args(cfg, forward))
