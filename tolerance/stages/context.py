"""The context of one stage comparison, and how it reads each side's tensors: the comparison
device, typed entries, and the golden's live (token, k) slots with the row each side keeps them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_verify.spec import Mode, MoEProblem, Stage, Trace
from tolerance.metrics import first_rows
from tolerance.policy import CONTRACT_REASON, Check
from tolerance.results import FIRST_ROWS, CheckResult, ContractError, Worst, entry


@dataclass(frozen=True)
class Ctx:
    """One stage comparison: both traces, the problem, the policy's Check for the stage, the mode,
    and where both sides are compared (`comparison_device`)."""

    golden: Trace
    other: Trace
    problem: MoEProblem
    check: Check
    mode: Mode
    device: torch.device

    @property
    def rank(self) -> int:
        return self.other.rank

    @property
    def name(self) -> str:
        return self.other.backend

    def token(self, t: int) -> int:
        """Global token of local row t (ep+ht receives a subset, named by route.token_index)."""
        route = self.golden[Stage.ROUTE] if Stage.ROUTE in self.golden else {}
        index = route.get("token_index")
        return int(index[t]) if isinstance(index, torch.Tensor) else t

    def token_note(self, t: int) -> str:
        """'; golden routes token t to experts [...]', or '' where the golden has no route."""
        route = self.golden[Stage.ROUTE] if Stage.ROUTE in self.golden else {}
        ids = route.get("topk_ids")
        if not isinstance(ids, torch.Tensor) or t >= ids.shape[0]:
            return ""
        return f"; golden routes token {self.token(t)} to experts {[int(e) for e in ids[t]]}"

    def pair(self, stage: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(golden, other) tensors of `stage.name`, both on the comparison device."""
        return (
            tensor_of(self.golden, stage, name, self.device),
            tensor_of(self.other, stage, name, self.device),
        )


def comparison_device(golden: Trace, stage: str) -> torch.device:
    """Where a stage is compared: on the golden's device, so a GPU run is compared on the GPU
    (host copies and float64 math on the host were 90% of a DeepSeek-V3 EP8 verify,
    docs/gpu-results.md); the tested side is moved there when it lives elsewhere."""
    outs = golden[stage] if stage in golden else {}
    for value in outs.values():
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def tensor_of(trace: Trace, stage: str, name: str, device: torch.device) -> torch.Tensor:
    """trace[stage][name] on `device`; a ContractError when it is not a tensor."""
    value = entry(trace, stage, name)
    if not isinstance(value, torch.Tensor):
        raise ContractError(
            f"{trace.backend} {stage}.{name} is {type(value).__name__}, not a tensor"
        )
    return value.detach().to(device)


def int_of(trace: Trace, stage: str, name: str) -> int:
    """trace[stage][name] as a Python int (a host int or a one-element tensor)."""
    value = entry(trace, stage, name)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return int(value.item())
    if isinstance(value, int):
        return value
    raise ContractError(f"{trace.backend} {stage}.{name} must be an int, got {value!r}")


# Live (token, k) slots ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Slots:
    """The golden's live (token, k) slots and their rows on each side.

    tk [L, 2] (token, k); gold_rows / other_rows [L]; experts [L] global ids (-1 unknown).
    """

    tk: torch.Tensor
    gold_rows: torch.Tensor
    other_rows: torch.Tensor
    experts: torch.Tensor

    def __len__(self) -> int:
        return self.tk.shape[0]

    def select(self, keep: torch.Tensor) -> Slots:
        return Slots(self.tk[keep], self.gold_rows[keep], self.other_rows[keep], self.experts[keep])


def live_slots(golden: Trace, layout: Trace, device: torch.device | None = None) -> Slots:
    """Live slots of the golden, with other rows read from `layout`'s permute.inv_perm; on
    `device` (the golden permute's device unless given)."""
    if Stage.PERMUTE in layout and layout.failure(Stage.PERMUTE) is not None:
        raise ContractError(
            f"{layout.backend}'s permute was skipped or raised, so its rows cannot be keyed by "
            "(token, k)"
        )
    if device is None:
        device = comparison_device(golden, Stage.PERMUTE)
    g_inv = tensor_of(golden, Stage.PERMUTE, "inv_perm", device).to(torch.int64)
    o_inv = tensor_of(layout, Stage.PERMUTE, "inv_perm", device).to(torch.int64)
    if o_inv.shape != g_inv.shape:
        raise ContractError(
            f"{layout.backend} permute.inv_perm is {tuple(o_inv.shape)}, "
            f"golden {tuple(g_inv.shape)}"
        )
    live = g_inv >= 0
    experts = torch.full(g_inv.shape, -1, dtype=torch.int64, device=device)
    if Stage.ROUTE in golden and isinstance(golden[Stage.ROUTE].get("topk_ids"), torch.Tensor):
        ids = golden[Stage.ROUTE]["topk_ids"].detach().to(device, torch.int64)
        if ids.shape == g_inv.shape:
            experts = ids
    return Slots(live.nonzero(), g_inv[live], o_inv[live], experts[live])


def downstream_slots(ctx: Ctx) -> Slots:
    """Slots for a stage after permute, keyed by the permute that stage consumed: the golden's in
    isolated mode (the backend ran on the golden's upstream), the backend's own when chained."""
    layout = ctx.other if ctx.mode == Mode.CHAINED else ctx.golden
    return live_slots(ctx.golden, layout, ctx.device)


def slot_worst(ctx: Ctx, s: Slots, i: int, **values: object) -> Worst:
    """Coordinates of slot i (global token, k, expert, rank, the other side's row), plus `values`
    (column, golden, other) as Worst fields."""
    expert = int(s.experts[i])
    return Worst(
        token=ctx.token(int(s.tk[i, 0])),
        k=int(s.tk[i, 1]),
        expert=expert if expert >= 0 else None,
        rank=ctx.rank,
        row=int(s.other_rows[i]),
        **values,
    )


def token_worst(ctx: Ctx, t: int) -> Worst:
    """Coordinates of local row t of a per-token tensor: its global token and the rank."""
    return Worst(token=ctx.token(t), rank=ctx.rank)


def slot_name(ctx: Ctx, s: Slots, i: int) -> str:
    return f"slot (token {ctx.token(int(s.tk[i, 0]))}, k {int(s.tk[i, 1])})"


def rows_in_range(ctx: Ctx, s: Slots, n_rows: int, what: str) -> tuple[Slots, CheckResult | None]:
    """Keep slots whose other row indexes a tensor of n_rows rows; a failed check otherwise."""
    ok = (s.other_rows >= 0) & (s.other_rows < n_rows)
    if bool(ok.all()):
        return s, None
    i = int(torch.nonzero(~ok)[0, 0])
    bad = int((~ok).sum())
    result = CheckResult(
        "row map",
        False,
        bad,
        0,
        CONTRACT_REASON,
        slot_worst(ctx, s, i),
        f"{bad} of {len(s)} live slots map outside {ctx.name} {what} ({n_rows} rows); first: "
        f"{slot_name(ctx, s, i)} -> row {int(s.other_rows[i])}",
        beyond={"slots": bad},
        first_rows=tuple(slot_worst(ctx, s, r) for r in first_rows(~ok, FIRST_ROWS)),
    )
    return s.select(ok), result
