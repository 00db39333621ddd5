"""The production forward as one registered custom op, as vLLM ships its MoE layer.

`torch.ops.moe_verify.fused_moe` is registered through `torch.library` with a fake (meta)
implementation for tracing and torch.compile, `workspace` declared as the one argument it
mutates, and the `needs_exact_strides` tag, so Inductor hands every tensor over with the
strides eager mode would (vLLM #49928: Inductor rewrote a TMA-aligned scale's strides, and the
kernel read out of bounds). `needs_fixed_stride_order`, vLLM's default, keeps only the order: an
MN-major scale built in the graph loses its TMA padding (tests/optimized/test_op.py). The real
implementation is `optimized.production.forward`: the registered backend's own stage methods,
graph-safe (no host syncs; the exact-count path reads the counts once), workspaces sized for the
token bound, DeepGEMM's alignment scope set inside the op.

Which backend runs is a registered name (`register_backend`): `OptimizedBackend`, a kernel
developer's subclass or wrapper of it, any backend of the stage protocol, or a deliberately wrong
one, runs under capture and compile exactly as ours does, through the same stage methods
`moe-verify run` verifies. The problem travels as its
JSON (`MoEProblem.to_dict`), so the op needs nothing but its arguments. `recording` collects the
stage outputs of every call made inside it (the taps of a CUDA-graph capture).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator

import torch

from moe_verify.spec import Backend, Engine, MoEProblem, QuantizedWeight, check_backend_object
from optimized import production
from optimized.production import ForwardConfig, RankWeights, Taps

OP_NAME = "moe_verify::fused_moe"

_BACKENDS: dict[str, Backend] = {}
_sinks: list[Taps] = []


def register_backend(backend: Backend, name: str | None = None) -> str:
    """Make `backend` (any backend of the stage protocol) callable through the op under `name`
    (default: its `name`), replacing one of that name. Returns the name to pass as the op's
    `backend` argument."""
    check_backend_object(backend, "register_backend: backend")
    key = backend.name if name is None else name
    if not isinstance(key, str) or not key:
        raise ValueError(f"register_backend: name must be a non-empty string, got {key!r}")
    _BACKENDS[key] = backend
    return key


def registered_names() -> frozenset[str]:
    return frozenset(_BACKENDS)


def registered_backend(name: str) -> Backend:
    if name not in _BACKENDS and name == "optimized":
        from optimized.backend import OptimizedBackend

        register_backend(OptimizedBackend())
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"{OP_NAME}: no backend named {name!r} is registered (known: "
            f"{sorted({'optimized', *_BACKENDS})}); register it with "
            "optimized.op.register_backend"
        ) from None


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
def _config(problem: str, rank: int, engine: str) -> ForwardConfig:
    return ForwardConfig(MoEProblem.from_dict(json.loads(problem)), rank, Engine(engine))


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
    problem: str,
    rank: int,
    engine: str,
    backend: str,
) -> torch.Tensor:
    """One rank's routed-expert MoE forward: out bf16 [T, H].

    hidden_states bf16 [T, H]; topk_ids [T, k] signed global ids (-1 = none; ids outside the
    expert map are skipped); topk_weights fp32 [T, k]; w13 / w2 this rank's quantized experts
    with their scales in the GEMM engine's layout (`production.prepare_rank_weights`);
    expert_map int32 [E_global] or None; workspace uint8, `production.workspace_bytes` for T.
    problem: the MoEProblem as JSON; rank; engine: the resolved GEMM engine; backend: the
    registered backend's name (`register_backend`).
    """
    cfg = _config(problem, rank, engine)
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
    runner = registered_backend(backend)
    return production.forward(
        runner, cfg, hidden_states, topk_ids, topk_weights, weights, workspace, taps
    )


@fused_moe.register_fake
def _(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    # Exactly what the real op returns: a fresh contiguous bf16 [T, H] (ep_gather's output). The
    # output depends on no other argument's shape, so the rest are taken as they come.
    return hidden_states.new_empty(hidden_states.shape, dtype=torch.bfloat16)


def op_args(cfg: ForwardConfig, backend: str = "optimized") -> dict[str, object]:
    """The op's non-tensor arguments for `cfg` and the registered backend `backend`."""
    return {
        "problem": json.dumps(cfg.problem.to_dict(), sort_keys=True),
        "rank": cfg.rank,
        "engine": cfg.engine.value,
        "backend": backend,
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
    backend: str = "optimized",
) -> torch.Tensor:
    """`torch.ops.moe_verify.fused_moe` with `cfg` and `weights` spelled out as its arguments."""
    args = tensor_args(hidden_states, topk_ids, topk_weights, weights, workspace)
    return torch.ops.moe_verify.fused_moe(*args, **op_args(cfg, backend))
