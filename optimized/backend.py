"""OptimizedBackend: the DeepGEMM MoE path (Triton kernels + DeepGEMM grouped GEMMs), staged.

Stage for stage it mirrors reference/moe.py, so the two read side by side. GEMM stages pick an
engine like vLLM's TritonOrDeepGemmExperts and record which one ran, and why.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_verify.spec import (
    MoEInputs,
    MoEProblem,
    QuantizedWeight,
    Recipe,
    StageSkipped,
    TopologyKind,
    Trace,
    run_stages,
)
from optimized import deepgemm
from optimized.kernels import act_quant, gather, grouped_gemm, quant, scatter
from optimized.routing import select_experts
from optimized.topology import Shard, shard, tp_down_shard, tp_gate_up_shard

Outputs = dict[str, object]
ENGINES = ("auto", "deepgemm", "triton")
# vLLM _valid_deep_gemm: below this intermediate size Triton is preferred for speed.
_DEEP_GEMM_MIN_INTERMEDIATE = 512
# Bytes of canary on each side of a workspace: a multiple of 512, so the workspace keeps the
# allocation's alignment (TMA needs 16-byte aligned addresses).
GUARD_BYTES = 4096


@dataclass(frozen=True)
class EngineChoice:
    engine: str  # "deepgemm" or "triton"
    reason: str


def choose_engine(problem: MoEProblem, num_tokens: int, override: str = "auto") -> EngineChoice:
    """TritonOrDeepGemm: DeepGEMM when E8M0 is in use or the shape is valid for it, else Triton.

    `override="deepgemm"` demands DeepGEMM (a stage it cannot run is skipped with the reason,
    never silently replaced); `"triton"` forces the Triton engine.
    """
    if override not in ENGINES:
        raise ValueError(f"engine: expected one of {ENGINES}, got {override!r}")
    if override == "triton":
        return EngineChoice("triton", "engine forced to triton")
    ok, why = deepgemm.support(problem)
    if override == "deepgemm":
        if not ok:
            raise StageSkipped(f"DeepGEMM demanded but cannot run here: {why}")
        return EngineChoice("deepgemm", f"engine forced to deepgemm ({why})")
    if not ok:
        return EngineChoice("triton", f"TritonOrDeepGemm fallback: {why}")
    if problem.scale_fmt.is_ue8m0:
        return EngineChoice("deepgemm", "E8M0 scales in use: DeepGEMM regardless of shape")
    a, ip, h = problem.alignment, problem.intermediate_per_rank, problem.hidden
    if num_tokens >= a and ip % a == 0 and h % a == 0 and ip > _DEEP_GEMM_MIN_INTERMEDIATE:
        return EngineChoice("deepgemm", "shape valid for DeepGEMM (_valid_deep_gemm)")
    return EngineChoice(
        "triton",
        f"_valid_deep_gemm fails (M={num_tokens} >= A={a}, I_p={ip} % A, H={h} % A, "
        f"I_p > {_DEEP_GEMM_MIN_INTERMEDIATE}): Triton",
    )


@functools.cache
def _canary(device: torch.device) -> torch.Tensor:
    """The guard bands' pattern: every byte value, scrambled, so no constant fill (a poison, a
    zeroing, a memset) can leave a band as it was."""
    return ((torch.arange(GUARD_BYTES) * 151 + 89) % 256).to(torch.uint8).to(device)


class OptimizedBackend:
    """The path under test. `engine` selects the GEMM engine: auto, deepgemm or triton."""

    name = "optimized"

    def __init__(self, engine: str = "auto", workspace: bool = False, poison: int | None = None):
        """workspace: kernels write into buffers allocated once per (name, shape) and reused
        across calls, as vLLM's workspaces are; stage outputs are then copies. Each workspace
        sits between two guard bands of a canary pattern, checked after every stage, so a kernel
        writing past either end of its output fails that stage by name. poison: fill each
        workspace with this byte before every use, so an element a kernel leaves unwritten shows
        up (the same case under two poisons must agree bitwise on everything it promises)."""
        if engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
        if poison is not None and not (workspace and 0 <= poison <= 255):
            raise ValueError(f"poison: a byte 0..255 with workspace=True, got {poison!r}")
        self.engine = engine
        self.workspace = workspace
        self.poison = poison
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
        self._buffers = {}
        self._guarded: dict[tuple[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
        self._guarded = {}  # each workspace's whole allocation: guard, buffer, guard (uint8)
        # Per-rank weights (and DeepGEMM's scale layouts) of the inputs object last seen; held,
        # so a new inputs object can never alias a stale cache entry through a reused id().
        self._weights_of: MoEInputs | None = None
        self._shards: dict[tuple[MoEProblem, int], Shard] = {}
        self._dg_scales: dict[tuple[MoEProblem, int, str], torch.Tensor] = {}

    def run(self, problem: MoEProblem, inputs: MoEInputs, rank: int = 0) -> Trace:
        return run_stages(self, problem, inputs, rank)

    def run_stage(
        self, stage: str, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> Outputs:
        method: Callable[..., Outputs] | None = getattr(self, f"_{stage}", None)
        if method is None:
            raise ValueError(f"stage {stage!r} is not a stage of the optimized MoE")
        try:
            outputs = method(problem, inputs, upstream, rank)
        except StageSkipped:
            self.guard_hits()  # re-armed; a stage that did not run wrote nothing to judge
            raise
        except Exception as exc:
            hits = self.guard_hits()
            if hits:  # the stage failed and wrote out of bounds: report both
                raise RuntimeError(f"{type(exc).__name__}: {exc}; and {stage} {hits}") from exc
            raise
        hits = self.guard_hits()
        if hits:
            raise RuntimeError(f"{stage} {hits}")
        return outputs

    def _buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The reused (and, with a poison, freshly poisoned) workspace `name`; None when off."""
        if not self.workspace:
            return None
        key = (name, tuple(shape), dtype, device)
        if key not in self._buffers:
            nbytes = math.prod(shape) * dtype.itemsize
            whole = torch.empty(nbytes + 2 * GUARD_BYTES, dtype=torch.uint8, device=device)
            canary = _canary(device)
            whole[:GUARD_BYTES] = canary
            whole[GUARD_BYTES + nbytes :] = canary
            self._guarded[key] = whole
            self._buffers[key] = whole[GUARD_BYTES : GUARD_BYTES + nbytes].view(dtype).view(shape)
        buf = self._buffers[key]
        if self.poison is not None:
            buf.view(torch.uint8).fill_(self.poison)
        return buf

    def guard_hits(self) -> str:
        """What changed in the guard bands around the workspaces since the last look ("" when
        nothing did): an out-of-bounds write that did not fault. Every band is re-armed, so
        the next stage is judged on its own writes. (A subclass that writes after
        `run_stage` returns is charged to the next stage.)"""
        hits = []
        for (name, shape, dtype, _), whole in self._guarded.items():
            canary = _canary(whole.device)
            for side, band in (("before", whole[:GUARD_BYTES]), ("after", whole[-GUARD_BYTES:])):
                changed = (band != canary).nonzero()[:, 0]
                if changed.numel() == 0:
                    continue
                band.copy_(canary)
                if side == "before":
                    where = f"nearest at byte {int(changed[-1]) - GUARD_BYTES} before its start"
                else:
                    where = f"nearest at byte +{int(changed[0])} past its end"
                hits.append(
                    f"changed {changed.numel()} bytes of the guard band {side} workspace "
                    f"{name!r} ({dtype} {tuple(shape)}), {where}"
                )
        return "; ".join(hits)

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """A stage output the trace may keep: a copy when it lives in a reused workspace."""
        return t.clone() if self.workspace else t

    def _deepgemm_weight_scales(
        self, p: MoEProblem, x: MoEInputs, rank: int, which: str, w: QuantizedWeight
    ) -> torch.Tensor:
        """This rank's w13/w2 scales in DeepGEMM's layout, transformed once per inputs object."""
        self.shard(p, x, rank)  # resets the caches when x is a new inputs object
        key = (p, rank, which)
        if key not in self._dg_scales:
            self._dg_scales[key] = deepgemm.prepare_weight_scales(w, p.scale_fmt.is_ue8m0)
        return self._dg_scales[key]

    def shard(self, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Shard:
        if inputs is not self._weights_of:
            self._weights_of, self._shards, self._dg_scales = inputs, {}, {}
        key = (problem, rank)
        if key not in self._shards:
            self._shards[key] = shard(problem, inputs.w13_q, inputs.w2_q, rank)
        return self._shards[key]

    # -- stages ----------------------------------------------------------------------------------

    def _route(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        ids, weights = select_experts(p, x)
        if p.topology.kind is not TopologyKind.EP_HT:
            return {"topk_ids": ids, "topk_weights": weights}
        expert_map = self.shard(p, x, rank).expert_map
        assert expert_map is not None
        local = torch.where(ids >= 0, expert_map[ids.long().clamp(min=0)], -1)
        received = (local >= 0).any(dim=1).nonzero().squeeze(1)
        return {
            "topk_ids": ids[received].to(torch.int64),
            "topk_weights": weights[received],
            "token_index": received,
        }

    def _quant_input(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        hidden = x.hidden_states
        if p.topology.kind is TopologyKind.EP_HT:
            hidden = hidden[up["route"]["token_index"]]
        if p.recipe is Recipe.MXFP8:
            q, s = quant.quantize_mxfp8(hidden, 32)
        else:
            q, s = quant.quantize_fp8_groups(hidden, 128, p.scale_fmt)
        return {"a1q": q, "a1q_scale": s}

    def _align(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        sh = self.shard(p, x, rank)
        ids = up["route"]["topk_ids"]
        counts = scatter.count_expert_tokens(ids, sh.num_local_experts, sh.expert_map)
        if p.topology.kind is TopologyKind.EP_HT:
            m_sum = scatter.aligned_m_sum_exact(counts, p.alignment)
        else:
            m_sum = scatter.aligned_m_sum_upper_bound(
                ids.shape[0], ids.shape[1], sh.num_local_experts, p.alignment
            )
        return {"M_sum": m_sum, "alignment": p.alignment, "counts": counts}

    def _permute(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        sh = self.shard(p, x, rank)
        align = up["align"]
        a1q = up["quant_input"]["a1q"]
        a_perm, a_scale_perm, m_indices, inv_perm, expert_start = scatter.ep_scatter(
            a1q,
            up["quant_input"]["a1q_scale"],
            up["route"]["topk_ids"],
            align["counts"],
            sh.num_local_experts,
            align["alignment"],
            align["M_sum"],
            sh.expert_map,
            a_perm_out=self._buffer(
                "a_perm", (align["M_sum"], a1q.shape[1]), a1q.dtype, a1q.device
            ),
        )
        return {
            "a_perm": self._own(a_perm),
            "a_scale_perm": a_scale_perm,
            "m_indices": m_indices,
            "inv_perm": inv_perm,
            "expert_start": expert_start,
        }

    def _gemm1(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        if "dispatch" in up:
            d = up["dispatch"]
            r = self._batched_gemm(
                p, x, up, rank, "w13", d["a_batched"], d["a_scale_batched"], p.recipe.act_group
            )
            return {"mm1": r.pop("out"), **r}
        perm = up["permute"]
        choice = choose_engine(p, up["route"]["topk_ids"].shape[0], self.engine)
        w = self.shard(p, x, rank).w13
        mm1 = self._grouped_gemm(
            choice,
            p,
            x,
            rank,
            "w13",
            perm["a_perm"],
            perm["a_scale_perm"],
            p.recipe.act_group,
            w,
            perm["m_indices"],
        )
        return {"mm1": mm1, "engine": choice.engine, "engine_reason": choice.reason}

    def _act_quant(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        if p.recipe is Recipe.MXFP4_W4A8 and p.activation.kind != "silu":
            raise ValueError("mxfp4_w4a8: the FP4 experts support silu (with optional clamp) only")
        mm1 = up["gemm1"]["mm1"]
        batch = mm1.shape[:-1]
        flat = mm1.reshape(-1, mm1.shape[-1])
        out_q = None
        if mm1.dim() == 2:
            out_q = self._buffer(
                "a2q", (flat.shape[0], flat.shape[1] // 2), torch.float8_e4m3fn, mm1.device
            )
        q, s = act_quant.silu_mul_quant(flat, p.activation, _act_group(p), p.scale_fmt, out_q)
        q = self._own(q)
        if mm1.dim() == 3:  # batched layout keeps its [E_l, max_tokens, ...] shape
            return {"a2q": q.view(*batch, q.shape[-1]), "a2q_scale": s.reshape(*batch, s.shape[-1])}
        return {"a2q": q, "a2q_scale": s}

    def _gemm2(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        act = up["act_quant"]
        if "dispatch" in up:
            r = self._batched_gemm(
                p, x, up, rank, "w2", act["a2q"], act["a2q_scale"], _act_group(p)
            )
            return {"mm2": r.pop("out"), **r}
        choice = choose_engine(p, up["route"]["topk_ids"].shape[0], self.engine)
        w = self.shard(p, x, rank).w2
        mm2 = self._grouped_gemm(
            choice,
            p,
            x,
            rank,
            "w2",
            act["a2q"],
            act["a2q_scale"],
            _act_group(p),
            w,
            up["permute"]["m_indices"],
        )
        return {"mm2": mm2, "engine": choice.engine, "engine_reason": choice.reason}

    def _gather(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        route = up["route"]
        if "dispatch" in up:  # LL combine: weighted fp32 sum over each slot's batched row
            mm2, d = up["gemm2"]["mm2"], up["dispatch"]
            rows = torch.where(d["slot"] >= 0, d["slot_expert"] * mm2.shape[1] + d["slot"], -1)
            out = gather.ep_gather(
                mm2.reshape(-1, mm2.shape[-1]),
                d["slot_expert"],
                route["topk_weights"],
                rows.to(torch.int32),
            )
            return {"out": out}
        mm2, ids = up["gemm2"]["mm2"], route["topk_ids"]
        out = gather.ep_gather(
            mm2,
            ids,
            route["topk_weights"],
            up["permute"]["inv_perm"],
            self.shard(p, x, rank).expert_map,
            out=self._buffer("out", (ids.shape[0], mm2.shape[1]), torch.bfloat16, mm2.device),
        )
        return {"out": self._own(out)}

    def _shared(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        """Shared experts: a dense gated MLP on every token, this rank's intermediate shard, with
        the same kernels (one group: every row is expert 0). vLLM runs it through dense FP8
        linears, not the DeepGEMM MoE path, so the Triton engine computes it here."""
        if x.shared_w13 is None or x.shared_w2 is None:
            raise ValueError("shared_experts > 0 needs inputs with shared_w13 / shared_w2")
        size = p.topology.size
        i_s = x.shared_w2.shape[2]
        w13 = tp_gate_up_shard(x.shared_w13, i_s, i_s // size, rank)
        w2 = tp_down_shard(x.shared_w2, i_s // size, rank)
        hidden = x.hidden_states
        if p.recipe is Recipe.MXFP8:
            a, bytes_ = quant.quantize_mxfp8(hidden, 32)
            a_scale = quant.pack_ue8m0(bytes_)
        else:
            a, a_scale = quant.quantize_fp8_groups(hidden, 128, p.scale_fmt)
        rows = hidden.shape[0]
        if rows == 0:
            return {"out": torch.zeros(0, p.hidden, dtype=torch.bfloat16, device=hidden.device)}
        every_row = torch.zeros(rows, dtype=torch.int32, device=hidden.device)
        mm1 = grouped_gemm.grouped_gemm(
            a, a_scale, p.recipe.act_group, w13.q, w13.scale, w13.block, every_row, rows
        )
        a2, a2_scale = act_quant.silu_mul_quant(mm1, p.activation, _act_group(p), p.scale_fmt)
        out = grouped_gemm.grouped_gemm(
            a2, a2_scale, _act_group(p), w2.q, w2.scale, w2.block, every_row, rows
        )
        return {"out": out, "engine": "triton"}

    # -- batched low-latency layout (ep:N+ll) ----------------------------------------------------

    def _dispatch(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        """Stands in for DeepEP's low-latency dispatch (a communication kernel, not under test
        here): each local expert's slots numbered in token order into a [max_tokens, H] batch."""
        sh = self.shard(p, x, rank)
        ids = up["route"]["topk_ids"]
        a1q, a1q_scale = up["quant_input"]["a1q"], up["quant_input"]["a1q_scale"]
        e_l, t_max = sh.num_local_experts, p.ll_max_tokens
        if e_l == 0:  # this rank owns no expert: empty batches, every slot skipped
            skipped = torch.full(ids.shape, -1, dtype=torch.int32, device=ids.device)
            return {
                "a_batched": a1q.new_empty(0, t_max, a1q.shape[1]),
                "a_scale_batched": a1q_scale.new_empty(0, t_max, a1q_scale.shape[1]),
                "masked_m": torch.zeros(0, dtype=torch.int32, device=ids.device),
                "slot": skipped,
                "slot_expert": skipped.clone(),
                "expected_m": 1,
            }
        local = ids.long()
        if sh.expert_map is not None:
            local = torch.where(local >= 0, sh.expert_map.long()[local.clamp(min=0)], -1)
        flat = local.flatten()
        one_hot = torch.nn.functional.one_hot(flat.clamp(min=0), e_l) * (flat >= 0).unsqueeze(1)
        slot_of = (torch.cumsum(one_hot, dim=0) - one_hot).gather(1, flat.clamp(min=0)[:, None])
        slot = torch.where(flat >= 0, slot_of.squeeze(1), -1).view_as(local)
        masked_m = one_hot.sum(dim=0).to(torch.int32)
        tokens = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(local)
        live = slot >= 0
        a_b = torch.zeros(e_l, t_max, a1q.shape[1], dtype=torch.uint8, device=a1q.device)
        s_b = torch.zeros(e_l, t_max, a1q_scale.shape[1], dtype=a1q_scale.dtype, device=a1q.device)
        a_b[local[live], slot[live]] = a1q.view(torch.uint8)[tokens[live]]
        s_b[local[live], slot[live]] = a1q_scale[tokens[live]]
        return {
            "a_batched": a_b.view(torch.float8_e4m3fn),
            "a_scale_batched": s_b,
            "masked_m": masked_m,
            "slot": slot.to(torch.int32),
            "slot_expert": torch.where(live, local, -1).to(torch.int32),
            "expected_m": max(1, -(-int(masked_m.sum()) // max(e_l, 1))),
        }

    def _batched_gemm(
        self,
        p: MoEProblem,
        x: MoEInputs,
        up: Trace,
        rank: int,
        which: str,
        a: torch.Tensor,
        a_scale: torch.Tensor,
        a_group: int,
    ) -> Outputs:
        d = up["dispatch"]
        e_l, t_max, k = a.shape
        choice = choose_engine(p, up["route"]["topk_ids"].shape[0], self.engine)
        sh = self.shard(p, x, rank)
        w = sh.w13 if which == "w13" else sh.w2
        if choice.engine == "deepgemm":
            out = deepgemm.m_grouped_gemm_masked(
                a,
                a_scale,
                w,
                self._deepgemm_weight_scales(p, x, rank, which, w),
                d["masked_m"],
                int(d["expected_m"]),
                p.scale_fmt.is_ue8m0,
            )
        else:
            rows = torch.arange(t_max, device=a.device)[None, :]
            m_indices = (
                torch.where(
                    rows < d["masked_m"][:, None],
                    torch.arange(e_l, device=a.device, dtype=torch.int32)[:, None],
                    -1,
                )
                .reshape(-1)
                .to(torch.int32)
            )
            out = grouped_gemm.grouped_gemm(
                a.reshape(e_l * t_max, k),
                a_scale.reshape(e_l * t_max, a_scale.shape[-1]),
                a_group,
                w.q,
                w.scale,
                w.block,
                m_indices,
                t_max,
            ).view(e_l, t_max, w.shape[1])
        return {"out": out, "engine": choice.engine, "engine_reason": choice.reason}

    # -- engines ---------------------------------------------------------------------------------

    def _grouped_gemm(
        self,
        choice: EngineChoice,
        p: MoEProblem,
        x: MoEInputs,
        rank: int,
        which: str,
        a: torch.Tensor,
        a_scale: torch.Tensor,
        a_group: int,
        w: QuantizedWeight,
        m_indices: torch.Tensor,
    ) -> torch.Tensor:
        out = self._buffer(f"mm_{which}", (a.shape[0], w.shape[1]), torch.bfloat16, a.device)
        if choice.engine == "triton":
            d = grouped_gemm.grouped_gemm(
                a, a_scale, a_group, w.q, w.scale, w.block, m_indices, p.alignment, out=out
            )
            return self._own(d)
        d = deepgemm.m_grouped_gemm(
            a,
            a_scale,
            w,
            self._deepgemm_weight_scales(p, x, rank, which, w),
            m_indices,
            p.alignment,
            a_group,
            p.scale_fmt.is_ue8m0,
            out=out,
        )
        return self._own(d)


def _act_group(problem: MoEProblem) -> int:
    """GEMM2's activation group: 32 for MXFP8; 128 otherwise (FP4 experts requant at 128)."""
    return 32 if problem.recipe is Recipe.MXFP8 else 128
