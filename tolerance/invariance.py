"""Metamorphic checks: two runs of one backend that differ only in something that must not matter
agree bit for bit on everything the stage promises (a check kind of its own, named after the
setting and the pair of values: "invariance alignment: 64 vs 128").

The settings (`INVARIANCES`): the workspace poison byte (a kernel that leaves a promised element
unwritten passes one poison by luck and fails the other: vLLM's NaN-poisoned workspace check;
rtp-llm PR #1098 and SGLang issue #33106 found unwritten rows this way), the segment alignment where
both are legal, the permuted buffer's capacity (the upper-bound vs the exact M_sum: DeepGEMM #331's
output changed with capacity alone), the batch capacity of the low-latency layout (DeepEP's
max_tokens), and DeepGEMM's performance hints (expected_m of the masked GEMM, the number of SMs).
The golden is not involved: the two traces are compared with each other, live rows keyed by (token,
k) through the permute each run read, since a permuted row's position is not deterministic; a
batched (ep:N+ll) trace is read as a contiguous one (`flatten_batched`), its dispatch as the
permute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_verify.spec import INVARIANCE_KINDS, Stage, Trace
from tolerance.results import CheckResult, ContractError, Worst
from tolerance.stages.context import live_slots
from tolerance.stages.layouts import flatten_batched


@dataclass(frozen=True)
class Invariance:
    """A setting that must not change any promised output, and the reason it must not."""

    kind: str
    reason: str

    def name(self, pair: str) -> str:
        return f"invariance {self.kind}: {pair}"


# Why each of spec's INVARIANCE_KINDS must not change a promised output.
_REASONS = {
    "poison": "a run under another workspace poison must agree bit for bit on every promised "
    "element (docs/tolerance.md, 'Poisoned workspaces')",
    "alignment": "the segment alignment only places rows (where both values are legal "
    "BLOCK_Ms): every live row's value must not move",
    "m_sum": "the permuted buffer's capacity (upper-bound vs exact M_sum) only adds padding "
    "rows: DeepGEMM #331 changed live outputs with capacity alone",
    "ll_capacity": "the batch capacity of the ep:N+ll layout (DeepEP's max_tokens) only adds rows "
    "past masked_m, which the masked GEMM never reads: every live row's value must not move",
    "expected_m": "expected_m is a scheduling hint of DeepGEMM's masked GEMM, not part of the math",
    "num_sms": "the SMs DeepGEMM may use change its schedule (deep_gemm.set_num_sms), not its math",
}
INVARIANCES = {kind: Invariance(kind, _REASONS[kind]) for kind in INVARIANCE_KINDS}
POISON_REASON = INVARIANCES["poison"].reason

# Permuted outputs: one row per live (token, k) slot, padding rows unpromised. A batched trace's
# dispatch is compared as the permute `flatten_batched` makes of it: its batches' rows and scales.
_PERMUTED = {
    Stage.PERMUTE: ("a_perm",),
    Stage.DISPATCH: ("a_perm", "a_scale_perm"),
    Stage.GEMM1: ("mm1",),
    Stage.ACT_QUANT: ("a2q",),
    Stage.GEMM2: ("mm2",),
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bytes of `x` per row, so NaN payloads and -0.0 count."""
    x = x.contiguous()
    return x.view(torch.uint8).reshape(x.shape[0], -1) if x.dim() else x.view(torch.uint8)


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (_bits(a) != _bits(b)).reshape(a.shape[0], -1).any(dim=1)


def agreement(
    stage: str,
    first: Trace,
    second: Trace,
    label: str,
    layouts: tuple[Trace, Trace],
    invariance: Invariance = INVARIANCES["poison"],
) -> CheckResult | None:
    """`stage` of two runs that differ only in `invariance`'s setting (`label` names the pair,
    e.g. '0x00 vs 0xff', '64 vs 128'); None when the stage did not run in both or has nothing to
    compare (its outputs are host values or layouts whose padding is unpromised and not keyed
    here).

    `layouts`: the traces whose permute each run's `stage` read its rows from: each run's own
    when chained, the golden's (both) when isolated. A run's own permute (or dispatch) keys its
    own permute (dispatch) stage. On a GPU two runs order a segment's rows differently (atomics),
    so a row is found through the permute that placed it, never by its position. Batched traces
    are flattened first: a live slot's row is its expert's batch start plus its slot, so two
    runs whose batches hold different capacities compare row for row."""
    if first.failure(stage) is not None or second.failure(stage) is not None:
        return None
    name = f"poison {label}" if invariance.kind == "poison" else invariance.name(label)
    if stage in (Stage.PERMUTE, Stage.DISPATCH):
        layouts = (first, second)
    try:
        first, second = flatten_batched(first), flatten_batched(second)
        layouts = (flatten_batched(layouts[0]), flatten_batched(layouts[1]))
    except ContractError:  # a dispatch without the entries that key its rows
        return None
    if stage in _PERMUTED and all(Stage.PERMUTE in t for t in layouts):
        try:
            slots = live_slots(*layouts)
        except ContractError:
            return None
        outputs = Stage.PERMUTE if stage == Stage.DISPATCH else stage
        bad, total, worst = 0, 0, None
        for key in _PERMUTED[stage]:
            a, b = first[outputs].get(key), second[outputs].get(key)
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                continue
            rows_a, rows_b = a[slots.gold_rows], b[slots.other_rows.to(a.device)]
            differ = _rows_differ(rows_a, rows_b.to(a.device))
            total += len(slots)
            bad += int(differ.sum())
            if worst is None and bool(differ.any()):
                i = int(differ.nonzero()[0, 0])
                worst = Worst(token=int(slots.tk[i, 0]), k=int(slots.tk[i, 1]))
        what = "live rows"
    elif stage in (Stage.ROUTE, Stage.QUANT_INPUT, Stage.GATHER, Stage.SHARED):
        bad, total, worst = 0, 0, None
        for key, a in first[stage].items():
            b = second[stage].get(key)
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not a.dim():
                continue
            differ = _rows_differ(a, b.to(a.device))
            total += a.shape[0]
            bad += int(differ.sum())
            if worst is None and bool(differ.any()):
                worst = Worst(token=int(differ.nonzero()[0, 0]))
        what = "token rows"
    else:
        return None
    if total == 0:
        return None
    detail = f"{bad} of {total} {what} differ between {invariance.kind} {label}"
    return CheckResult(name, bad == 0, bad, 0, invariance.reason, worst, detail, beyond={what: bad})
