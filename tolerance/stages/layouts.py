"""Layout decoders for comparison: packed UE8M0 scale bytes, fp32 vs E8M0 scale codes, the psum
grouped layout read per row, and the batched low-latency layout seen as a contiguous one.
Written here, not imported from `reference`, so the comparison stays independent of the golden
it judges.
"""

from __future__ import annotations

import torch

from moe_verify.spec import GroupedLayout, Mode, Stage, Trace, round_up
from tolerance.metrics import bits
from tolerance.policy import CONTRACT_REASON
from tolerance.results import CheckResult, ContractError, entry
from tolerance.stages.context import Ctx, int_of

E8M0_NAN = 0xFF  # the one E8M0 byte that is no number: the kernels read it as NaN


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Exponent bytes of packed UE8M0 scales: int32 [R, P] -> int64 [R, groups].

    Byte j (little-endian) of word p holds group 4p + j; any strides (MN-major TMA-aligned storage
    is read through its logical view). Pad bytes past `groups` are dropped.
    """
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ContractError(
            f"packed UE8M0 scales must be int32 [R, P], got {packed.dtype} {tuple(packed.shape)}"
        )
    if 4 * packed.shape[1] < groups:
        raise ContractError(
            f"packed scales hold {4 * packed.shape[1]} groups per row, need {groups}"
        )
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=packed.device)
    data = (packed.to(torch.int64)[:, :, None] >> shifts) & 0xFF
    return data.reshape(packed.shape[0], 4 * packed.shape[1])[:, :groups]


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """float64 [...]: 2^(byte - 127); byte 0xFF is NaN (as the kernel reads it)."""
    values = torch.exp2(codes.to(torch.float64) - 127.0)
    return torch.where(codes == E8M0_NAN, torch.full_like(values, float("nan")), values)


def fp32_to_e8m0(values: torch.Tensor) -> torch.Tensor:
    """int64 [...]: the exponent byte of each fp32 power of two (+0.0 -> 0), -1 where the value
    has a sign or mantissa bit set, so it has no exact UE8M0 byte."""
    raw = bits(values.to(torch.float32)).to(torch.int64) & 0xFFFFFFFF
    exact = (raw & 0x807FFFFF) == 0
    return torch.where(exact, raw >> 23, torch.full_like(raw, -1))


def scale_codes(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, str]:
    """Canonical bit-level form of one scale tensor: (int64 [R, groups], "fp32" | "e8m0").

    fp32 [R, groups] -> raw bits; uint8 [R, groups] E8M0 bytes and int32 packed -> bytes.
    """
    if x.dtype == torch.int32:
        return unpack_ue8m0(x, groups), "e8m0"
    if x.dim() != 2 or x.shape[1] != groups:
        raise ContractError(f"scales must be [rows, {groups}], got {x.dtype} {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        return x.to(torch.int64), "e8m0"
    if x.dtype == torch.float32:
        return bits(x).to(torch.int64) & 0xFFFFFFFF, "fp32"
    raise ContractError(f"scales must be fp32, uint8 E8M0 or int32 packed, got {x.dtype}")


def comparable_scale_codes(
    other: torch.Tensor, golden: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Both sides' scales as int64 codes that are equal exactly when the scales are, and the code
    kind ("fp32" raw bits, or "e8m0" bytes).

    Same storage kind: raw bits / bytes. fp32 vs E8M0 bytes: the fp32 side becomes bytes, with -1
    for a value that is not a power of two (it can then never match).
    """
    co, ko = scale_codes(other, groups)
    cg, kg = scale_codes(golden, groups)
    if ko == kg:
        return co, cg, ko
    co = fp32_to_e8m0(other) if ko == "fp32" else co
    cg = fp32_to_e8m0(golden) if kg == "fp32" else cg
    return co, cg, "e8m0"


def scale_values(x: torch.Tensor, groups: int) -> torch.Tensor:
    """float64 [R, groups] dequantization scales from fp32, uint8 E8M0 or int32 packed storage."""
    codes, kind = scale_codes(x, groups)
    return x.to(torch.float64) if kind == "fp32" else e8m0_to_float(codes)


def psum_row_experts(expert_ends: torch.Tensor, rows: int, alignment: int) -> torch.Tensor:
    """The psum grouped layout read per row: int64 [rows], expert e on [round_up(end_{e-1}, A),
    end_e) (end_{-1} = 0), -1 on the gap and tail rows, which belong to no expert (DeepGEMM's
    scheduler; docs/stage-contract.md#grouped-layouts). An end below its start or past `rows` simply
    owns fewer rows."""
    ends = expert_ends.to(torch.int64)
    out = torch.full((rows,), -1, dtype=torch.int64, device=ends.device)
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[max(start, 0) : max(min(end, rows), 0)] = e
        start = round_up(end, alignment)
    return out


def tested_m_indices(ctx: Ctx) -> tuple[torch.Tensor, str]:
    """int64 [M_sum]: the tested permute's rows read per row, and where that came from. A kernel
    returns the grouped layout it built: its `m_indices`, or, for the psum layout alone, its
    `expert_ends`, read here as DeepGEMM reads them (gap and tail rows -1). The reading is the
    comparison's, never the adapter's: a backend does not derive the layout it did not build."""
    perm = ctx.other[Stage.PERMUTE]
    if "m_indices" in perm:
        return entry(ctx.other, Stage.PERMUTE, "m_indices").to(ctx.device, torch.int64), ""
    ends = perm.get("expert_ends")
    if not isinstance(ends, torch.Tensor):
        raise ContractError(f"{ctx.name} permute returns neither m_indices nor expert_ends")
    rows = entry(ctx.other, Stage.PERMUTE, "a_perm").shape[0]
    align = int_of(consumed(ctx), Stage.ALIGN, "alignment")
    return psum_row_experts(ends.to(ctx.device), rows, align), " (read from its psum expert_ends)"


def consumed(ctx: Ctx) -> Trace:
    """The trace whose upstream stages the tested stage read: its own when chained, the
    golden's in isolated mode."""
    return ctx.other if ctx.mode == Mode.CHAINED else ctx.golden


def reported_layout(ctx: Ctx, stage: str) -> GroupedLayout | None:
    """The grouped layout the tested side says `stage` read (its "layout" entry), if it says."""
    value = ctx.other[stage].get("layout")
    if value is None:
        return None
    try:
        return GroupedLayout(value)
    except ValueError:
        raise ContractError(
            f"{ctx.name} {stage}.layout is {value!r}; expected one of "
            f"{[v.value for v in GroupedLayout if v is not GroupedLayout.AUTO]}"
        ) from None


def tested_layout(ctx: Ctx, stage: str) -> GroupedLayout:
    """The layout to hold `stage` to: the one the tested side reports, else the one the problem
    forces, else m_indices (whose promises are the stricter: every padding row)."""
    layout = reported_layout(ctx, stage)
    if layout is None or layout is GroupedLayout.AUTO:
        forced = ctx.problem.grouped_layout
        layout = forced if forced is not GroupedLayout.AUTO else GroupedLayout.M_INDICES
    return layout


def layout_check(ctx: Ctx, stage: str) -> CheckResult | None:
    """A layout the problem forces is the one the tested stage reports it read; None when the
    problem leaves the choice to the backend (grouped_layout auto) or the layout is batched."""
    forced = ctx.problem.grouped_layout
    if forced is GroupedLayout.AUTO or Stage.DISPATCH in ctx.golden:
        return None
    got = reported_layout(ctx, stage)
    ok = got is forced
    return CheckResult(
        "layout",
        ok,
        0 if ok else 1,
        0,
        CONTRACT_REASON,
        None,
        f"the problem forces {forced}; {ctx.name} {stage} reports "
        f"{got if got is not None else 'no layout entry'}",
    )


def row_experts(ctx: Ctx, layout: GroupedLayout, rows: int) -> torch.Tensor | None:
    """int64 [rows]: each row's local expert in the grouped layout the tested stage read (from
    the permute it consumed), -1 where the layout leaves the row to no expert; None where the
    trace has no contiguous layout (the batched one)."""
    trace = consumed(ctx)
    if Stage.ALIGN not in trace or Stage.PERMUTE not in trace:
        return None
    perm = trace[Stage.PERMUTE]
    if layout is GroupedLayout.PSUM:
        ends = perm.get("expert_ends")
        if not isinstance(ends, torch.Tensor):
            raise ContractError(f"{trace.backend} permute has no expert_ends for the psum layout")
        return psum_row_experts(ends.to(ctx.device), rows, int_of(trace, Stage.ALIGN, "alignment"))
    m = entry(trace, Stage.PERMUTE, "m_indices")
    out = torch.full((rows,), -1, dtype=torch.int64, device=ctx.device)
    n = min(rows, m.numel())
    out[:n] = m[:n].to(ctx.device, torch.int64)
    return out


def flatten_batched(trace: Trace) -> Trace:
    """The batched low-latency layout (ep:N+ll) seen as a contiguous one, so every comparison of
    the permuted layout applies: expert e's batch is rows [e*T, (e+1)*T) of one buffer, a
    synthesized `permute` stage keys (token, k) to row slot_expert*T + slot, and the batched
    GEMM / act_quant outputs [E_l, T, N] become [E_l*T, N]. Other traces pass through."""
    if Stage.DISPATCH not in trace:
        return trace
    out = Trace(trace.backend, trace.rank)
    for name, outs in trace.items():
        if name in (Stage.GEMM1, Stage.ACT_QUANT, Stage.GEMM2) and trace.failure(name) is None:
            outs = {
                k: v.reshape(-1, v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() == 3 else v
                for k, v in outs.items()
            }
        out.add(name, outs)
        if name == Stage.DISPATCH and trace.failure(name) is None:
            a = entry(trace, Stage.DISPATCH, "a_batched")
            e_l, t_max = a.shape[0], a.shape[1]
            slot = entry(trace, Stage.DISPATCH, "slot").long()
            expert = entry(trace, Stage.DISPATCH, "slot_expert").long()
            masked_m = entry(trace, Stage.DISPATCH, "masked_m").long()
            scales = entry(trace, Stage.DISPATCH, "a_scale_batched")
            row = torch.arange(t_max, device=masked_m.device)[None, :]
            local = torch.arange(e_l, device=masked_m.device)[:, None]
            m_indices = torch.where(row < masked_m[:, None], local, -1).reshape(-1)
            out.add(
                Stage.PERMUTE,
                {
                    "a_perm": a.reshape(e_l * t_max, a.shape[-1]),
                    "a_scale_perm": scales.reshape(e_l * t_max, scales.shape[-1]),
                    "m_indices": m_indices.to(torch.int32),
                    "inv_perm": torch.where(slot >= 0, expert * t_max + slot, -1).to(torch.int32),
                },
            )
    return out
