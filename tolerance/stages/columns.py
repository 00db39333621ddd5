"""gemm1's column order: the halves of an `mm1` row, [gate | up] or [up | gate].

DeepGEMM multiplies whatever w13 it is given; the activation decides which half is the gate. A
gemm1 that writes up-first declares it (`column_order`, moe_verify.spec.Gemm1Columns) and is
compared with its halves exchanged; its act_quant is fed the golden's mm1 up-first too
(moe_verify/run/runner.py `fed_upstream`). An undeclared up-first gemm1 fails, and the failure
says that its halves exchanged would match (docs/stage-contract.md#gemm1-column-order).
"""

from __future__ import annotations

import torch

from moe_verify.spec import COLUMN_ORDER, GEMM_OUTPUT, Gemm1Columns, Stage, Trace

MM1 = GEMM_OUTPUT[Stage.GEMM1]


def swap_halves(mm1: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with its two halves exchanged: [gate | up] <-> [up | gate]."""
    gate, up = mm1.chunk(2, dim=-1)
    return torch.cat([up, gate], dim=-1)


def declared(trace: Trace) -> Gemm1Columns:
    """The column order `trace`'s gemm1 declares: gate-first where it declares none, or a value
    the contract refuses (tolerance/contract.py names it)."""
    if Stage.GEMM1 not in trace or trace.failure(Stage.GEMM1):
        return Gemm1Columns.GATE_FIRST
    value = trace[Stage.GEMM1].get(COLUMN_ORDER, Gemm1Columns.GATE_FIRST)
    return Gemm1Columns(value) if value in set(Gemm1Columns) else Gemm1Columns.GATE_FIRST


def mm1_of(trace: Trace) -> torch.Tensor | None:
    """gemm1's mm1 where it is a tensor of two halves, else None (the contract says why)."""
    if Stage.GEMM1 not in trace or trace.failure(Stage.GEMM1):
        return None
    mm1 = trace[Stage.GEMM1].get(MM1)
    return mm1 if isinstance(mm1, torch.Tensor) and mm1.shape[-1] % 2 == 0 else None


def in_order(trace: Trace, order: Gemm1Columns) -> Trace:
    """`trace` with its gemm1's mm1 in `order` (the trace itself where it already is)."""
    mm1 = mm1_of(trace)
    if declared(trace) is order or mm1 is None:
        return trace
    return trace.replaced(Stage.GEMM1, **{MM1: swap_halves(mm1), COLUMN_ORDER: order.value})


def gate_first(trace: Trace) -> Trace:
    """The tested trace as the golden writes gemm1: an up-first mm1 read gate-first."""
    return in_order(trace, Gemm1Columns.GATE_FIRST)
