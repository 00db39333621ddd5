"""Production mode: the optimized forward of one rank as vLLM ships it, with no host syncs.

vLLM runs the MoE layer as one custom op over preallocated workspaces, captured in CUDA graphs at
a token bound (seed article §2.8, appendix B). This module is that forward: the same kernels as
`OptimizedBackend`, stage by stage under the same names, but

- no value validation (every kernel is called with `validate=False`: a host check reads the
  device, which breaks capture and costs a sync per check);
- M_sum is the upper bound of the token count the call is shaped with (a host int from shapes),
  so per-expert counts never travel to the host; the exact-count path (ep:N+ht, DeepEP's
  high-throughput dispatch) reads the counts once, says so (`ForwardConfig.host_syncs`), and
  cannot be captured;
- the four M_sum-sized buffers (a_perm, mm1, a2q, mm2) are carved from one caller-owned
  workspace sized by `workspace_bytes` for the bound, as vLLM's `workspace_shapes` are; the
  small index and scale tensors are allocated by their kernels (inside a graph: once, at capture);
- DeepGEMM's alignment scope (its process-global BLOCK_M) is set inside each GEMM call.

`forward` returns the output and, when asked, every stage's outputs under the stage contract's
names (the *taps*). Captured in a CUDA graph, those tensors are graph-resident: each replay
rewrites them, so reading them after a replay gives that replay's per-stage trace.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_verify.spec import (
    Activation,
    Engine,
    GroupedLayout,
    MoEProblem,
    QuantizedWeight,
    Recipe,
    ScaleFmt,
    Stage,
    TopologyKind,
)
from optimized import deepgemm
from optimized.deepgemm import choose_engine, choose_grouped_layout
from optimized.kernels import act_quant, gather, grouped_gemm, quant, scatter
from optimized.kernels._validate import fail
from optimized.topology import hosted_experts, shard

Outputs = dict[str, object]
Taps = dict[str, Outputs]

BATCHED = "batched"  # the ep:N+ll masked layout (DeepEP low-latency), beside GroupedLayout's two
LAYOUTS = (GroupedLayout.M_INDICES.value, GroupedLayout.PSUM.value, BATCHED)


@dataclass(frozen=True)
class ForwardConfig:
    """What one rank's production forward is specialized on: host values only, fixed for the
    life of a captured graph.

    layout: "m_indices" or "psum" (contiguous grouped GEMMs) or "batched" (masked GEMMs).
    exact_m_sum: size the permuted buffer from the counts (ep:N+ht); one host read per call.
    ll_max_tokens: rows per local expert's batch in the batched layout (its capacity).
    """

    recipe: Recipe
    scale_fmt: ScaleFmt
    activation: Activation
    alignment: int
    layout: str
    engine: Engine
    num_local_experts: int
    hidden: int
    intermediate: int
    topk: int
    exact_m_sum: bool = False
    ll_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"ForwardConfig.layout: expected one of {LAYOUTS}, got {self.layout!r}"
            )
        if self.engine is Engine.AUTO:
            raise ValueError("ForwardConfig.engine: a resolved engine (deepgemm or triton)")
        if self.layout == BATCHED and self.ll_max_tokens <= 0:
            raise ValueError("ForwardConfig: the batched layout needs ll_max_tokens > 0")

    @classmethod
    def for_problem(
        cls, problem: MoEProblem, rank: int, max_tokens: int, engine: Engine | str = Engine.AUTO
    ) -> ForwardConfig:
        """The config vLLM would run `problem`'s rank with, for calls of up to `max_tokens`
        tokens (the engine is chosen for the bound, as a captured graph fixes it)."""
        if problem.shared_experts:
            raise ValueError(
                "production mode runs the routed experts only: vLLM computes shared experts "
                f"outside the fused MoE op (got shared_experts={problem.shared_experts})"
            )
        kind = problem.topology.kind
        if kind is TopologyKind.EP_LL:
            layout = BATCHED
        else:
            layout = choose_grouped_layout(problem).layout.value
        hosted = len(hosted_experts(problem, rank))
        return cls(
            recipe=problem.recipe,
            scale_fmt=problem.scale_fmt,
            activation=problem.activation,
            alignment=problem.alignment,
            layout=layout,
            engine=choose_engine(problem, max_tokens, engine).engine,
            num_local_experts=hosted,
            hidden=problem.hidden,
            intermediate=problem.intermediate_per_rank,
            topk=problem.topk,
            exact_m_sum=kind is TopologyKind.EP_HT,
            ll_max_tokens=problem.ll_max_tokens if kind is TopologyKind.EP_LL else 0,
        )

    @property
    def host_syncs(self) -> int:
        """Device-to-host reads per call: 1 on the exact-count path (the counts), else 0."""
        return 1 if self.exact_m_sum else 0

    @property
    def capturable(self) -> bool:
        return not self.exact_m_sum

    def m_sum_bound(self, num_tokens: int) -> int:
        """Rows of the permuted buffer for a call of `num_tokens` tokens (the upper bound)."""
        return scatter.aligned_m_sum_upper_bound(
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
    cfg: ForwardConfig, problem: MoEProblem, w13: QuantizedWeight, w2: QuantizedWeight, rank: int
) -> RankWeights:
    """`rank`'s shard of the full weights, with scales transformed once for the engine (as vLLM
    post-processes weights at load time, never per call)."""
    sh = shard(problem, w13, w2, rank)
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
        at += -(-math.prod(shape) * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES
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


# -- the forward ------------------------------------------------------------------------------


class ProductionForward:
    """The optimized forward of one rank in production mode; stage methods named as the
    golden's, each `(cfg, weights, up) -> outputs` where `up` holds the earlier stages' outputs.

    To put your own kernel under graph replay, subclass and override its stage; register the
    subclass (`optimized.op.register_forward`) to run it through the custom op.
    """

    name = "optimized"
    _workspace: tuple[WorkspaceLayout, torch.Tensor] | None = None

    def forward(
        self,
        cfg: ForwardConfig,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: RankWeights,
        workspace: torch.Tensor,
        taps: Taps | None = None,
    ) -> torch.Tensor:
        """out bf16 [T, H] for `hidden_states` [T, H] bf16 routed by topk_ids / topk_weights
        [T, k] (global ids, -1 = none; ids outside [0, E_global) are skipped, as stale ids in
        CUDA-graph padding rows must be). `taps`, when given, receives each stage's outputs."""
        fn = "production.forward"
        t = hidden_states.shape[0]
        layout = workspace_layout(cfg, t)
        check_workspace(fn, workspace, layout.nbytes, hidden_states.device)
        up: Taps = {} if taps is None else taps
        up[Stage.ROUTE.value] = {"topk_ids": topk_ids, "topk_weights": topk_weights}
        stages = (
            (Stage.QUANT_INPUT, Stage.DISPATCH, Stage.GEMM1, Stage.ACT_QUANT, Stage.GEMM2)
            if cfg.layout == BATCHED
            else (Stage.QUANT_INPUT, Stage.ALIGN, Stage.PERMUTE, Stage.GEMM1, Stage.ACT_QUANT,
                  Stage.GEMM2)
        )  # fmt: skip
        with self.bound(layout, workspace):
            for stage in stages:
                up[stage.value] = getattr(self, stage.value)(cfg, hidden_states, weights, up)
            up[Stage.GATHER.value] = self.gather(cfg, hidden_states, weights, up)
        out = up[Stage.GATHER.value]["out"]
        assert isinstance(out, torch.Tensor)
        return out

    @contextlib.contextmanager
    def bound(self, layout: WorkspaceLayout, workspace: torch.Tensor) -> Iterator[None]:
        """Within this block, stage methods carve their buffers from `workspace` (as `forward`
        binds it for one call; a stage timed or replayed alone binds it the same way)."""
        self._workspace = (layout, workspace)
        try:
            yield
        finally:
            self._workspace = None

    def buffers(self, rows: int) -> dict[str, torch.Tensor]:
        """This call's workspace views, `rows` rows each."""
        assert self._workspace is not None, "buffers() is for stage methods inside forward()"
        layout, workspace = self._workspace
        if rows > layout.rows:
            # Only the exact-count path sizes per call.
            return {
                name: torch.empty((rows, *shape[1:]), dtype=dtype, device=workspace.device)
                for name, (_, shape, dtype) in layout.offsets.items()
            }
        return carve(layout, workspace, rows)

    # -- stages ----------------------------------------------------------------------------------

    def quant_input(
        self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps
    ) -> Outputs:
        if cfg.recipe is Recipe.MXFP8:
            q, s = quant.quantize_mxfp8(hidden, cfg.recipe.act_group)
        else:
            q, s = quant.quantize_fp8_groups(hidden, cfg.recipe.act_group, cfg.scale_fmt)
        return {"a1q": q, "a1q_scale": s}

    def align(self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps) -> Outputs:
        ids = up["route"]["topk_ids"]
        counts = scatter.count_expert_tokens(
            ids, cfg.num_local_experts, w.expert_map, validate=False
        )
        if cfg.exact_m_sum:  # the one host read of the exact-count path
            m_sum = scatter.aligned_m_sum_exact(counts.tolist(), cfg.alignment)
        else:
            m_sum = cfg.m_sum_bound(ids.shape[0])
        return {"M_sum": m_sum, "alignment": cfg.alignment, "counts": counts}

    def permute(
        self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps
    ) -> Outputs:
        q, align = up["quant_input"], up["align"]
        m_sum = align["M_sum"]
        out = scatter.ep_scatter(
            q["a1q"],
            q["a1q_scale"],
            up["route"]["topk_ids"],
            align["counts"],
            cfg.num_local_experts,
            cfg.alignment,
            m_sum,
            w.expert_map,
            validate=False,
            a_perm_out=self.buffers(m_sum)["a_perm"],
        )
        return {
            "a_perm": out.a_perm,
            "a_scale_perm": out.a_scale_perm,
            "m_indices": out.m_indices,
            "expert_ends": out.expert_ends,
            "inv_perm": out.inv_perm,
            "expert_start": out.expert_start,
            "layout": cfg.layout,
        }

    def dispatch(
        self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps
    ) -> Outputs:
        q = up["quant_input"]
        return batched_dispatch(
            q["a1q"],
            q["a1q_scale"],
            up["route"]["topk_ids"],
            w.expert_map,
            cfg.num_local_experts,
            cfg.ll_max_tokens,
            expected_m=max(1, -(-hidden.shape[0] * cfg.topk // max(cfg.num_local_experts, 1))),
            a_out=self.buffers(cfg.num_local_experts * cfg.ll_max_tokens)["a_perm"],
        )

    def _grouped_layout(self, cfg: ForwardConfig, up: Taps) -> torch.Tensor:
        perm = up["permute"]
        return perm["expert_ends" if cfg.layout == GroupedLayout.PSUM.value else "m_indices"]

    def _gemm(
        self,
        cfg: ForwardConfig,
        which: str,
        a: torch.Tensor,
        a_scale: torch.Tensor,
        w: RankWeights,
        up: Taps,
        out: torch.Tensor,
    ) -> torch.Tensor:
        weight, w_scale = (w.w13, w.w13_scale) if which == "w13" else (w.w2, w.w2_scale)
        group = cfg.recipe.act_group
        if cfg.layout == BATCHED:
            d = up["dispatch"]
            e_l, t_max, k = a.shape
            if cfg.engine is Engine.DEEPGEMM:
                return deepgemm.m_grouped_gemm_masked(
                    a, a_scale, weight, w_scale, d["masked_m"], int(d["expected_m"]),
                    use_ue8m0=cfg.scale_fmt.is_ue8m0, validate=False,
                    out=out.view(e_l, t_max, weight.shape[1]),
                )  # fmt: skip
            return grouped_gemm.grouped_gemm(
                a.reshape(e_l * t_max, k), a_scale.reshape(e_l * t_max, a_scale.shape[-1]),
                group, weight.q, w_scale, weight.block, d["batch_m_indices"], t_max,
                validate=False, out=out,
            ).view(e_l, t_max, weight.shape[1])  # fmt: skip
        psum = cfg.layout == GroupedLayout.PSUM.value
        grouped = self._grouped_layout(cfg, up)
        if cfg.engine is Engine.DEEPGEMM:
            return deepgemm.m_grouped_gemm(
                a, a_scale, group, weight, w_scale, grouped, cfg.alignment,
                use_ue8m0=cfg.scale_fmt.is_ue8m0, use_psum_layout=psum, validate=False, out=out,
            )  # fmt: skip
        return grouped_gemm.grouped_gemm(
            a, a_scale, group, weight.q, w_scale, weight.block, grouped, cfg.alignment,
            use_psum_layout=psum, validate=False, out=out,
        )  # fmt: skip

    def gemm1(self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps) -> Outputs:
        if cfg.layout == BATCHED:
            d = up["dispatch"]
            a, s = d["a_batched"], d["a_scale_batched"]
        else:
            a, s = up["permute"]["a_perm"], up["permute"]["a_scale_perm"]
        rows = a.shape[0] * (a.shape[1] if a.dim() == 3 else 1)
        mm1 = self._gemm(cfg, "w13", a, s, w, up, self.buffers(rows)["mm1"])
        return {"mm1": mm1, **self._gemm_tags(cfg)}

    def act_quant(
        self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps
    ) -> Outputs:
        mm1 = up["gemm1"]["mm1"]
        batch = mm1.shape[:-1]
        flat = mm1.reshape(-1, mm1.shape[-1])
        psum = cfg.layout == GroupedLayout.PSUM.value
        q, s = act_quant.silu_mul_quant(
            flat,
            cfg.activation,
            cfg.recipe.act_group,
            cfg.scale_fmt,
            self.buffers(flat.shape[0])["a2q"],
            expert_ends=self._grouped_layout(cfg, up) if psum else None,
            expert_alignment=cfg.alignment if psum else 0,
            validate=False,
        )
        if mm1.dim() == 3:
            return {"a2q": q.view(*batch, q.shape[-1]), "a2q_scale": s.reshape(*batch, s.shape[-1])}
        return {"a2q": q, "a2q_scale": s, "layout": cfg.layout}

    def gemm2(self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps) -> Outputs:
        act = up["act_quant"]
        a = act["a2q"]
        rows = a.shape[0] * (a.shape[1] if a.dim() == 3 else 1)
        mm2 = self._gemm(cfg, "w2", a, act["a2q_scale"], w, up, self.buffers(rows)["mm2"])
        return {"mm2": mm2, **self._gemm_tags(cfg)}

    @staticmethod
    def _gemm_tags(cfg: ForwardConfig) -> Outputs:
        """The engine a GEMM stage ran on, and the contiguous layout it read (the batched
        layout is the stage list's, not a tag)."""
        tags: Outputs = {"engine": cfg.engine}
        if cfg.layout != BATCHED:
            tags["layout"] = cfg.layout
        return tags

    def gather(self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps) -> Outputs:
        route, mm2 = up["route"], up["gemm2"]["mm2"]
        if cfg.layout == BATCHED:
            d = up["dispatch"]
            rows = torch.where(d["slot"] >= 0, d["slot_expert"] * mm2.shape[1] + d["slot"], -1)
            out = gather.ep_gather(
                mm2.reshape(-1, mm2.shape[-1]),
                d["slot_expert"],
                route["topk_weights"],
                rows.to(torch.int32),
                validate=False,
            )
            return {"out": out}
        out = gather.ep_gather(
            mm2,
            route["topk_ids"],
            route["topk_weights"],
            up["permute"]["inv_perm"],
            w.expert_map,
            validate=False,
        )
        return {"out": out}


def local_ids(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int
) -> torch.Tensor:
    """Local expert of every slot, -1 where it is skipped: -1, an id outside the map (a stale id
    in a CUDA-graph padding row must never index past it: vLLM test_expert_map_bounds), an
    expert on another rank, or a local id out of range. No host sync."""
    ids = topk_ids.long()
    if expert_map is not None:
        in_map = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(
            in_map, expert_map.long()[ids.clamp(0, max(expert_map.numel() - 1, 0))], -1
        )
    return torch.where((ids >= 0) & (ids < num_local), ids, -1)


def batched_dispatch(
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_local: int,
    max_tokens: int,
    *,
    expected_m: int | None = None,
    a_out: torch.Tensor | None = None,
) -> Outputs:
    """Stands in for DeepEP's low-latency dispatch (a communication kernel, not under test):
    each local expert's slots numbered in token order into its [max_tokens, H] batch, with no
    host sync. A slot past an expert's capacity is dropped (its `slot` is -1) and masked_m is
    capped at the capacity, as a full receive buffer would.

    returns a_batched fp8 [E_l, max_tokens, H] (rows past masked_m zero), a_scale_batched
    [E_l, max_tokens, H/G], masked_m int32 [E_l], slot and slot_expert int32 [M, k] (-1 where
    skipped), expected_m (the host hint the masked GEMM takes; None: the mean batch, one host
    read, as verification mode may afford), batch_m_indices int32
    [E_l * max_tokens] (the batches as one contiguous layout, -1 past masked_m).
    """
    m, h = a1q.shape
    device = a1q.device
    local = local_ids(topk_ids, expert_map, num_local)
    flat = local.flatten()
    live = flat >= 0
    if num_local == 0:
        one_hot = torch.zeros(flat.numel(), 0, dtype=torch.int64, device=device)
        slot = torch.full_like(flat, -1)
    else:
        one_hot = torch.nn.functional.one_hot(flat.clamp(min=0), num_local) * live[:, None]
        before = torch.cumsum(one_hot, dim=0) - one_hot
        slot = torch.where(live, before.gather(1, flat.clamp(min=0)[:, None]).squeeze(1), -1)
    slot = torch.where(slot < max_tokens, slot, -1)
    live = slot >= 0
    masked_m = one_hot.sum(dim=0).clamp(max=max_tokens).to(torch.int32)
    rows = num_local * max_tokens
    # Skipped slots write into one trash row past the batches, so no index is data-dependent.
    dest = torch.where(live, flat.clamp(min=0) * max_tokens + slot.clamp(min=0), rows)
    token = torch.arange(m * local.shape[1], device=device) // max(local.shape[1], 1)
    a_b = torch.zeros(rows + 1, h, dtype=torch.uint8, device=device)
    a_b.index_copy_(0, dest, a1q.view(torch.uint8)[token])
    s_b = torch.zeros(rows + 1, a1q_scale.shape[1], dtype=a1q_scale.dtype, device=device)
    s_b.index_copy_(0, dest, a1q_scale[token])
    a_view = a_b[:rows]
    if a_out is not None:
        a_out.view(torch.uint8).copy_(a_view)
        a_view = a_out.view(torch.uint8)
    if expected_m is None:
        expected_m = max(1, -(-int(masked_m.sum()) // max(num_local, 1)))
    return {
        "a_batched": a_view.view(torch.float8_e4m3fn).view(num_local, max_tokens, h),
        "a_scale_batched": s_b[:rows].view(num_local, max_tokens, a1q_scale.shape[1]),
        "masked_m": masked_m,
        "slot": slot.view_as(local).to(torch.int32),
        "slot_expert": torch.where(live, flat, -1).view_as(local).to(torch.int32),
        "expected_m": expected_m,
        "batch_m_indices": batch_m_indices(masked_m, max_tokens),
    }


def batch_m_indices(masked_m: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """The batches as one contiguous grouped layout: int32 [E_l * max_tokens], the batch's
    expert on its first masked_m rows, -1 after (what the Triton engine's grouped GEMM reads)."""
    rows = torch.arange(max_tokens, device=masked_m.device)[None, :]
    experts = torch.arange(masked_m.numel(), device=masked_m.device, dtype=torch.int32)[:, None]
    return torch.where(rows < masked_m[:, None], experts, -1).reshape(-1).to(torch.int32)
