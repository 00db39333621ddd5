"""The masked layout outside DeepEP low latency: a dispatch written from the contract.

DeepGEMM's masked grouped GEMM reads each local expert's rows from a batch of its own,
[E_l, M_max, H], and only the first masked_m[e] rows of batch e. Nothing in it needs DeepEP: a
kernel may lay out a TP or plain EP rank's slots that way too (`MoEProblem(grouped_layout=
"masked")`; docs/stage-contract.md#grouped-layouts). These dispatches are written here from that
contract, by a sort rather than the optimized path's one-hot count:

- `SortedDispatch` (correct): the rank's live slots sorted by local expert (stable, so each
  expert's slots stay in (token, k) order), a slot's row in its batch being its place in the
  sorted run minus the run's start; the codes and scales copied there; everything else from
  the optimized path.
- `SortedDispatchFromOne` (wrong): the same with each batch's rows counted from 1, as an
  off-by-one start would. masked_m is right, so every batch's last slot lands on row masked_m,
  past what the GEMM reads, and that token loses an expert. Fails at dispatch.

Which padding bytes matter follows DeepGEMM's read path (docs/stage-contract.md, "Padding rows,
by who reads them"): with fp32 UE8M0-rounded scales DeepGEMM's packer reads every row of the
batches, past masked_m too; scales handed over already packed skip the packer, and the masked
GEMM reads no row past masked_m.

- `PrePackedDispatch` (correct, ue8m0_packed problems): the scales packed into UE8M0 words by
  the dispatch itself, each batch MN-major with TMA-aligned word columns; the rows past masked_m
  are left as the buffer held them (0xFF bytes, NaN to a kernel that read them). Passes.
- `UnwrittenFp32Padding` (wrong, UE8M0 problems with fp32 scales): fp32 scales whose rows past
  masked_m are left holding 0.3, not a power of two; DeepGEMM's packer reads them and traps.
  Fails at dispatch ("padding scales").
"""

from __future__ import annotations

import torch

from moe_verify.spec import Engine, Outputs, StageContext, StageDelegate
from optimized import OptimizedBackend


class SortedDispatch(StageDelegate):
    """dispatch by a stable sort of the slots' local experts; the other stages the optimized
    path's."""

    name = "sorted-dispatch"
    first_row = 0  # the row of each batch its first slot lands on

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(OptimizedBackend(engine=engine), self.name)

    def dispatch(self, ctx: StageContext) -> Outputs:
        up, shard, problem = ctx.upstream, ctx.shard, ctx.problem
        a1q, a1q_scale = up["quant_input"]["a1q"], up["quant_input"]["a1q_scale"]
        ids = up["route"]["topk_ids"].long()
        e_l, capacity = shard.num_local_experts, problem.ll_max_tokens
        local = ids
        if shard.expert_map is not None:  # global -> local id; -1: another rank's, or stale
            known = (ids >= 0) & (ids < shard.expert_map.numel())
            local = torch.where(known, shard.expert_map.long()[ids.clamp(0)], -1)
        local = torch.where((local >= 0) & (local < e_l), local, -1)
        flat = local.flatten()
        live = flat >= 0
        masked_m = torch.bincount(flat[live], minlength=e_l).to(torch.int32)
        order = torch.argsort(torch.where(live, flat, e_l), stable=True)[: int(live.sum())]
        starts = torch.cumsum(masked_m, 0) - masked_m
        experts = flat[order]
        rows = torch.arange(order.numel(), device=flat.device) - starts[experts] + self.first_row
        slot = torch.full_like(flat, -1)
        slot[order] = rows
        token = order // ids.shape[1]
        a_b = torch.zeros(e_l, capacity, a1q.shape[1], dtype=torch.uint8, device=a1q.device)
        s_b = torch.zeros(
            e_l, capacity, a1q_scale.shape[1], dtype=a1q_scale.dtype, device=a1q.device
        )
        a_b[experts, rows] = a1q.view(torch.uint8)[token]
        s_b[experts, rows] = a1q_scale[token]
        return {
            "a_batched": a_b.view(torch.float8_e4m3fn),
            "a_scale_batched": s_b,
            "masked_m": masked_m,
            "slot": slot.view_as(local).to(torch.int32),
            "slot_expert": local.to(torch.int32),
            "expected_m": max(1, -(-int(masked_m.sum()) // max(e_l, 1))),
        }


class PrePackedDispatch(SortedDispatch):
    """The batches' scales packed here (DeepGEMM's packer off), rows past masked_m unwritten."""

    name = "pre-packed-dispatch"

    def dispatch(self, ctx: StageContext) -> Outputs:
        out = super().dispatch(ctx)
        scales, masked_m = out["a_scale_batched"], out["masked_m"]
        e_l, rows, groups = scales.shape
        words, tma = -(-groups // 4), -(-rows // 4) * 4
        exponents = torch.zeros(e_l, rows, 4 * words, dtype=torch.int64, device=scales.device)
        exponents[..., :groups] = (scales.view(torch.int32).long() >> 23) & 0xFF
        live = torch.arange(rows, device=scales.device)[None, :] < masked_m[:, None]
        exponents[~live] = 0xFF  # never written: what the buffer held
        shifted = exponents.view(e_l, rows, words, 4) << torch.arange(
            0, 32, 8, device=scales.device
        )
        packed = shifted.sum(-1)
        packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
        stored = torch.empty_strided(
            (e_l, rows, words), (words * tma, 1, tma), dtype=torch.int32, device=scales.device
        )
        stored.copy_(packed)
        return {**out, "a_scale_batched": stored}


class UnwrittenFp32Padding(SortedDispatch):
    """Wrong: fp32 scales whose rows past masked_m hold 0.3, which DeepGEMM's packer reads."""

    name = "unwritten-fp32-padding"

    def dispatch(self, ctx: StageContext) -> Outputs:
        out = super().dispatch(ctx)
        scales, masked_m = out["a_scale_batched"].clone(), out["masked_m"]
        rows = torch.arange(scales.shape[1], device=scales.device)[None, :]
        scales[rows >= masked_m[:, None]] = 0.3
        return {**out, "a_scale_batched": scales}


class SortedDispatchFromOne(SortedDispatch):
    """Wrong: each batch's rows counted from 1, so its last slot lies past masked_m."""

    name = "sorted-dispatch-from-one"
    first_row = 1
