"""Provenance-tagged activations: each token carries its own index in bits that survive FP8 and
UE8M0 quantization exactly, so any permuted row says which token it came from. The tag is written
here (`tag_hidden_states`, for the inputs) and read here (`decode_*`, `check_permuted_tokens`,
`with_provenance`, for the comparison), so encoding and decoding cannot drift apart.

Group 0 of token t holds a 448 marker at column 0 and the base-16 digits of t at columns 1..4,
the rest of the group zero. With amax = 448 the group's scale is exactly 1 (fp32 and ceil-UE8M0)
or 1..2 (MXFP8's amax x fp32(1/448) rounding), and integers 0..15 (or their halves) are exact
e4m3 values, so dequantizing and rounding recovers t bit for bit in every recipe.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_verify.spec import Stage, Status, Trace
from tolerance.policy import PROVENANCE_REASON
from tolerance.results import CheckResult, StageResult, Worst

MARKER = 448.0
DIGITS = 4  # base-16 digits: tokens up to 65535
BASE = 16
TAG_COLUMNS = 32  # the smallest quantization group: the tag owns all of it
MAX_TOKENS = BASE**DIGITS


def tag_hidden_states(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [T, H] -> a copy whose first group encodes each row's token index."""
    tokens = hidden.shape[0]
    if tokens > MAX_TOKENS:
        raise ValueError(f"provenance: at most {MAX_TOKENS} tokens can be tagged, got {tokens}")
    out = hidden.clone()
    out[:, :TAG_COLUMNS] = 0
    out[:, 0] = MARKER
    t = torch.arange(tokens, device=hidden.device)
    for d in range(DIGITS):
        out[:, 1 + d] = ((t // BASE**d) % BASE).to(out.dtype)
    return out


def decode_tokens(values: torch.Tensor) -> torch.Tensor:
    """Dequantized rows [R, >=5] -> int64 [R] token index, -1 where the marker is missing."""
    scale = MARKER / values[:, 0].float()
    digits = (values[:, 1 : 1 + DIGITS].float() * scale.unsqueeze(1)).round().long()
    tokens = sum(digits[:, d] * BASE**d for d in range(DIGITS))
    valid = (values[:, 0].float() > 0) & (digits >= 0).all(1) & (digits < BASE).all(1)
    return torch.where(valid, tokens, torch.full_like(tokens, -1))


def decode_permuted(a_perm: torch.Tensor) -> torch.Tensor:
    """Token of every row of a permuted fp8 buffer [M_sum, H]: the codes of the tag group alone
    decode it, since the marker fixes that group's scale."""
    return decode_tokens(a_perm[:, : DIGITS + 1].float())


def check_permuted_tokens(
    topk_ids: torch.Tensor,
    inv_perm: torch.Tensor,
    a_perm: torch.Tensor,
    token_index: torch.Tensor | None = None,
) -> list[tuple[int, int, int, int]]:
    """(token, k, expert, found token) for every live slot whose row holds another token.

    token_index (ep+ht) names the global token of each received row; tokens are global."""
    live = inv_perm >= 0
    rows = inv_perm.long().clamp(min=0, max=max(a_perm.shape[0] - 1, 0))
    found = decode_permuted(a_perm)[rows] if a_perm.shape[0] else torch.full_like(rows, -1)
    local = torch.arange(inv_perm.shape[0], device=inv_perm.device)
    glob = token_index.to(local.device).long() if token_index is not None else local
    tokens = glob.unsqueeze(1).expand_as(rows)
    wrong = live & (found != tokens)
    return [
        (int(t), int(k), int(topk_ids[t, k]), int(found[t, k])) for t, k in wrong.nonzero().tolist()
    ]


def with_provenance(result: StageResult, trace: Trace, rank: int) -> StageResult:
    """Permute of a provenance-tagged case: `result` plus a "provenance" check naming the token
    each misplaced row of `trace` really holds; a failing check fails a stage that was not an
    error. Other stages, and a permute without an a_perm, come back unchanged."""
    if (
        result.stage != Stage.PERMUTE
        or Stage.PERMUTE not in trace
        or "a_perm" not in trace[Stage.PERMUTE]
    ):
        return result
    perm = trace[Stage.PERMUTE]
    route = trace[Stage.ROUTE]
    wrong = check_permuted_tokens(
        route["topk_ids"], perm["inv_perm"], perm["a_perm"], route.get("token_index")
    )
    worst = None
    if wrong:
        t, k, e, found = wrong[0]
        worst = Worst(token=t, k=k, expert=e, rank=rank, golden=t, other=found)
    listed = ", ".join(f"(t={t}, k={k}, e={e}) holds token {f}" for t, k, e, f in wrong[:5])
    check = CheckResult(
        "provenance",
        not wrong,
        len(wrong),
        0,
        PROVENANCE_REASON,
        worst,
        f"{len(wrong)} live slots hold another token's row" + (f": {listed}" if wrong else ""),
        beyond={"slots": len(wrong)},
    )
    status = result.status if not wrong or result.status is Status.ERROR else Status.FAIL
    return dataclasses.replace(result, checks=[*result.checks, check], status=status)
