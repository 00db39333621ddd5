"""Production mode: one rank's forward as vLLM ships it, through the same stage methods.

vLLM runs the MoE layer as one custom op over preallocated workspaces, captured in CUDA graphs at a
token bound. There is no second pipeline here: `forward` runs the backend's own stage methods
(`OptimizedBackend`, a user's subclass or wrapper of it, an adapter: any backend of the stage
protocol, `stage(ctx) -> outputs`)
with a graph-safe stage context (moe_verify/spec/context.py):

- no value validation (every kernel is called with `validate=False`: a host check reads the
  device, which breaks capture and costs a sync per check);
- M_sum is the upper bound of the token count the call is shaped with (a host int from shapes),
  so per-expert counts never travel to the host; the exact-count path (ep:N+ht, DeepEP's
  high-throughput dispatch) reads the counts once, says so (`ForwardConfig.host_syncs`), and
  cannot be captured;
- the four M_sum-sized buffers (a_perm, mm1, a2q, mm2) are carved from one caller-owned
  workspace sized by `workspace_bytes` for the bound, as vLLM's `workspace_shapes` are
  (`CarvedBuffers`, in place of verification's guarded workspaces); the small index and scale
  tensors are allocated by their kernels (inside a graph: once, at capture);
- the rank's weights are the ones the op was given (`RankWeights`), not a shard of the inputs;
- DeepGEMM's alignment scope (its process-global BLOCK_M) is set inside each GEMM call.

`forward` returns the output and, when asked, every stage's outputs under the stage contract's
names (the *taps*). Captured in a CUDA graph, those tensors are graph-resident: each replay
rewrites them, so reading them after a replay gives that replay's per-stage trace.
`running_stage()` names the stage running now, so a host read can be blamed on its stage.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moe_verify.spec import (
    Backend,
    Buffers,
    Engine,
    MoEInputs,
    MoEProblem,
    Outputs,  # noqa: E402 - the vocabulary names it once
    QuantizedWeight,
    RankShard,
    Recipe,
    ScaleFmt,
    Stage,
    StageContext,
    TopologyKind,
    Trace,
    call_stage,
    round_up,
)
from optimized import deepgemm
from optimized.deepgemm import choose_engine, choose_grouped_layout
from optimized.kernels import slot_counts
from optimized.kernels._validate import fail
from optimized.topology import hosted_experts, shard

Taps = dict[str, Outputs]

BATCHED = "batched"  # the ep:N+ll masked layout (DeepEP low-latency), beside GroupedLayout's two


@dataclass(frozen=True)
class ForwardConfig:
    """What one rank's production forward is specialized on, fixed for the life of a captured
    graph: the problem the stage methods are called with, the rank, and the GEMM engine resolved
    for the token bound (`for_problem`). Everything else is derived from those three.
    """

    problem: MoEProblem
    rank: int
    engine: Engine

    def __post_init__(self) -> None:
        if self.engine is Engine.AUTO:
            raise ValueError("ForwardConfig.engine: a resolved engine (deepgemm or triton)")
        if self.problem.shared_experts:
            raise ValueError(
                "production mode runs the routed experts only: vLLM computes shared experts "
                f"outside the fused MoE op (got shared_experts={self.problem.shared_experts})"
            )

    @classmethod
    def for_problem(
        cls, problem: MoEProblem, rank: int, max_tokens: int, engine: Engine | str = Engine.AUTO
    ) -> ForwardConfig:
        """The config vLLM would run `problem`'s rank with, for calls of up to `max_tokens`
        tokens (the engine is chosen for the bound, as a captured graph fixes it)."""
        return cls(problem, rank, choose_engine(problem, max_tokens, engine).engine)

    @property
    def layout(self) -> str:
        """ "m_indices" or "psum" (contiguous grouped GEMMs) or "batched" (masked GEMMs)."""
        if self.problem.batched:
            return BATCHED
        return choose_grouped_layout(self.problem).layout.value

    @property
    def exact_m_sum(self) -> bool:
        """Size the permuted buffer from the counts (ep:N+ht): one host read per call."""
        return self.problem.topology.kind is TopologyKind.EP_HT

    @property
    def ll_max_tokens(self) -> int:
        """Rows per local expert's batch in the batched layout (its capacity), else 0."""
        return self.problem.ll_max_tokens if self.layout == BATCHED else 0

    @property
    def num_local_experts(self) -> int:
        return len(hosted_experts(self.problem, self.rank))

    @property
    def recipe(self) -> Recipe:
        return self.problem.recipe

    @property
    def scale_fmt(self) -> ScaleFmt:
        return self.problem.scale_fmt

    @property
    def alignment(self) -> int:
        return self.problem.alignment

    @property
    def hidden(self) -> int:
        return self.problem.hidden

    @property
    def intermediate(self) -> int:
        return self.problem.intermediate_per_rank

    @property
    def topk(self) -> int:
        return self.problem.topk

    @property
    def host_syncs(self) -> int:
        """Device-to-host reads per call: 1 on the exact-count path (the counts), else 0."""
        return 1 if self.exact_m_sum else 0

    @property
    def capturable(self) -> bool:
        return not self.exact_m_sum

    def m_sum_bound(self, num_tokens: int) -> int:
        """Rows of the permuted buffer for a call of `num_tokens` tokens (the upper bound)."""
        return slot_counts.aligned_m_sum_upper_bound(
            num_tokens, self.topk, self.num_local_experts, self.alignment
        )


@dataclass(frozen=True)
class RankWeights:
    """One rank's weights as the production forward reads them: the quantized experts, their
    scales already in the GEMM engine's layout (`prepare_rank_weights`), and the expert map."""

    w13: QuantizedWeight
    w2: QuantizedWeight
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    expert_map: torch.Tensor | None


def prepare_rank_weights(
    cfg: ForwardConfig, w13: QuantizedWeight, w2: QuantizedWeight
) -> RankWeights:
    """`cfg.rank`'s shard of the full weights, with scales transformed once for the engine (as
    vLLM post-processes weights at load time, never per call)."""
    sh = shard(cfg.problem, w13, w2, cfg.rank)
    if cfg.engine is Engine.DEEPGEMM:
        ue8m0 = cfg.scale_fmt.is_ue8m0
        s13 = deepgemm.prepare_weight_scales(sh.w13, ue8m0)
        s2 = deepgemm.prepare_weight_scales(sh.w2, ue8m0)
    else:
        s13, s2 = sh.w13.scale, sh.w2.scale
    return RankWeights(sh.w13, sh.w2, s13, s2, sh.expert_map)


# -- the workspace ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkspaceLayout:
    """Byte offsets of the M_sum-sized buffers inside one workspace (each 256-byte aligned, so
    every view keeps the alignment TMA needs). Distinct regions: no stage reads a buffer another
    stage of the same call has overwritten, and each stays readable as that stage's tap."""

    rows: int
    offsets: dict[str, tuple[int, tuple[int, ...], torch.dtype]]
    nbytes: int


_ALIGN_BYTES = 256  # each buffer's offset inside the workspace
_TMA_ALIGN_BYTES = 16  # TMA descriptors need 16-byte aligned global addresses


def workspace_layout(cfg: ForwardConfig, num_tokens: int) -> WorkspaceLayout:
    """Where a_perm, mm1, a2q and mm2 live for calls of up to `num_tokens` tokens."""
    if cfg.layout == BATCHED:
        rows = cfg.num_local_experts * cfg.ll_max_tokens
    elif cfg.exact_m_sum:
        rows = 0  # sized per call from the counts: the exact path allocates
    else:
        rows = cfg.m_sum_bound(num_tokens)
    h, i = cfg.hidden, cfg.intermediate
    shapes = {
        "a_perm": ((rows, h), torch.float8_e4m3fn),
        "mm1": ((rows, 2 * i), torch.bfloat16),
        "a2q": ((rows, i), torch.float8_e4m3fn),
        "mm2": ((rows, h), torch.bfloat16),
    }
    offsets, at = {}, 0
    for name, (shape, dtype) in shapes.items():
        offsets[name] = (at, shape, dtype)
        at += round_up(math.prod(shape) * dtype.itemsize, _ALIGN_BYTES)
    return WorkspaceLayout(rows, offsets, at)


def workspace_bytes(cfg: ForwardConfig, num_tokens: int) -> int:
    """Bytes of the workspace a call of up to `num_tokens` tokens needs (vLLM workspace_shapes)."""
    return workspace_layout(cfg, num_tokens).nbytes


def carve(layout: WorkspaceLayout, workspace: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
    """Views of the workspace: each buffer's first `rows` rows (rows <= layout.rows)."""
    views = {}
    for name, (at, shape, dtype) in layout.offsets.items():
        n = math.prod(shape[1:]) * dtype.itemsize
        views[name] = workspace[at : at + rows * n].view(dtype).view(rows, *shape[1:])
    return views


def check_workspace(fn: str, workspace: torch.Tensor, need: int, device: torch.device) -> None:
    """Shape-level checks only (free): a uint8 1-D contiguous buffer of at least `need` bytes."""
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
        fail(fn, f"workspace must be a uint8 tensor, got {getattr(workspace, 'dtype', workspace)}")
    if workspace.dim() != 1 or not workspace.is_contiguous():
        fail(fn, f"workspace must be 1-D contiguous bytes, got shape {tuple(workspace.shape)}")
    if workspace.numel() < need:
        fail(
            fn,
            f"workspace has {workspace.numel()} bytes but this call needs {need} "
            "(workspace_bytes(cfg, num_tokens) for the token bound)",
        )
    if workspace.device != device:
        fail(fn, f"workspace is on {workspace.device} but the hidden states are on {device}")
    if workspace.data_ptr() % _TMA_ALIGN_BYTES:
        fail(fn, f"workspace must start on a {_TMA_ALIGN_BYTES}-byte boundary (TMA alignment)")


class CarvedBuffers:
    """Production mode's buffers, in the place of verification's guarded `Workspaces`: the
    M_sum-sized outputs (a_perm, mm1, a2q, mm2) are views of the caller's one workspace; any
    other name, or a shape the layout does not hold, gets None and its kernel allocates (the
    exact-count path, whose M_sum is known only per call, allocates its buffers)."""

    def __init__(self, layout: WorkspaceLayout, workspace: torch.Tensor) -> None:
        self.layout = layout
        self.workspace = workspace

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        if name not in self.layout.offsets:
            return None
        at, full, full_dtype = self.layout.offsets[name]
        rows = shape[0]
        if dtype != full_dtype or tuple(shape[1:]) != full[1:] or rows > full[0]:
            return None
        return carve(self.layout, self.workspace, rows)[name]

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """Production outputs stay in the workspace (the taps read them there)."""
        return t

    def guard_hits(self) -> str:
        """No guard bands in production mode: nothing to report, and nothing read back."""
        return ""


def rank_shard(cfg: ForwardConfig, weights: RankWeights) -> RankShard:
    """The shard a stage sees in production mode: the op's weights, with DeepGEMM's scale
    layouts already prepared (as vLLM transforms them at load time, never per call)."""
    prepared = {}
    if cfg.engine is Engine.DEEPGEMM:
        ue8m0 = cfg.scale_fmt.is_ue8m0
        prepared = {
            deepgemm.prepared_scale_key("w13", ue8m0): weights.w13_scale,
            deepgemm.prepared_scale_key("w2", ue8m0): weights.w2_scale,
        }
    experts = tuple(hosted_experts(cfg.problem, cfg.rank))
    return RankShard(experts, weights.expert_map, weights.w13, weights.w2, prepared)


def production_context(
    cfg: ForwardConfig, inputs: MoEInputs, upstream: Trace, shard: RankShard, buffers: Buffers
) -> StageContext:
    """A graph-safe stage context: no validation, no host reads, the op's weights and buffers,
    the engine resolved for the token bound."""
    return StageContext(
        cfg.problem,
        inputs,
        upstream,
        cfg.rank,
        buffers=buffers,
        validate=False,
        graph_safe=True,
        engine=cfg.engine,
        shard_of=lambda problem, inputs, rank: shard,
    )


def rank_inputs(hidden_states: torch.Tensor, weights: RankWeights) -> MoEInputs:
    """The `inputs` a stage method sees in production mode: this call's hidden states and this
    rank's weights (the op's arguments). No router logits or master weights travel into the op,
    so those fields are empty; the stage methods read weights through `ctx.shard`."""
    none = hidden_states.new_empty(0)
    return MoEInputs(
        hidden_states=hidden_states,
        router_logits=none,
        score_bias=None,
        topk_ids=None,
        topk_weights=None,
        w13=none,
        w2=none,
        w13_q=weights.w13,
        w2_q=weights.w2,
    )


_running: list[str] = []
# Called with each stage's name as it starts (eager calls only: a graph replay runs no Python).
stage_listeners: list[Callable[[str], None]] = []


def running_stage() -> str | None:
    """The stage a production forward is running now (None outside one): a host read detected
    inside the op is blamed on it (moe_verify/production/host_reads.py)."""
    return _running[-1] if _running else None


@contextlib.contextmanager
def _stage(stage: str) -> Iterator[None]:
    for listen in stage_listeners:
        listen(stage)
    _running.append(stage)
    try:
        yield
    finally:
        _running.pop()


def forward_stages(problem: MoEProblem) -> tuple[Stage, ...]:
    """The stages a production forward runs, in order: the problem's, after the route (the
    op's caller routes)."""
    return tuple(stage for stage in problem.stages if stage is not Stage.ROUTE)


def forward(
    backend: Backend,
    cfg: ForwardConfig,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: RankWeights,
    workspace: torch.Tensor,
    taps: Taps | None = None,
) -> torch.Tensor:
    """out bf16 [T, H]: `backend`'s own stage methods, graph-safe, for `hidden_states` [T, H]
    bf16 routed by topk_ids / topk_weights [T, k] (global ids, -1 = none; ids outside
    [0, E_global) are skipped, as stale ids in CUDA-graph padding rows must be). The route is the
    caller's; every stage after it runs the backend's method for it, exactly the one
    verification calls. `taps`, when given, receives each stage's outputs."""
    fn = "production.forward"
    layout = workspace_layout(cfg, hidden_states.shape[0])
    check_workspace(fn, workspace, layout.nbytes, hidden_states.device)
    rank = cfg.rank
    inputs = rank_inputs(hidden_states, weights)
    up = Trace(backend.name, rank)
    up.add(Stage.ROUTE, {"topk_ids": topk_ids, "topk_weights": topk_weights})
    shard, buffers = rank_shard(cfg, weights), CarvedBuffers(layout, workspace)
    for stage in forward_stages(cfg.problem):
        with _stage(stage.value):
            ctx = production_context(cfg, inputs, up, shard, buffers)
            up.add(stage, call_stage(backend, stage, ctx))
    if taps is not None:
        taps.update(up.items())
    out = up[Stage.GATHER]["out"]
    assert isinstance(out, torch.Tensor)
    return out


class ProductionForward:
    """Gone: production mode runs the backend's own stage methods (`forward` above)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        raise TypeError(
            f"{cls.__name__}: ProductionForward is gone. Write your kernel once as a backend of "
            "the stage protocol (a subclass or a wrapper of optimized.OptimizedBackend), with "
            "the stage method `stage(ctx) -> outputs`; `moe-verify run --backend "
            "module:Class` and `moe-verify graph --backend module:Class` both run it "
            "(docs/architecture.md, 'One stage protocol')."
        )

    def __init__(self) -> None:
        raise TypeError(
            "ProductionForward is gone: production mode runs a backend's stage methods "
            "(optimized.production.forward, optimized.op.register_backend)"
        )
