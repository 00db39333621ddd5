"""Chained runs: each token's k slots read in the golden's order.

The order of a token's experts inside its top-k row is not semantic: route compares ids as a set
per token (docs/stage-contract.md). Every later per-slot tensor, though, is keyed by (token, k):
inv_perm, the LL dispatch's slot and slot_expert, the route weights. A tested route that lists a
token's experts in another order than the golden's (torch.topk need not break a tie by the lowest
id, as the golden does; measured on the H200, nightly, grouped routing, T = 4096: 2 slots) would
pair the slot of one expert with the golden slot of another, and a correct kernel would fail at
permute. `aligned_slots` re-indexes the tested side's per-slot tensors into the golden's slot
order first; `slot_order` is the re-indexing.
"""

from __future__ import annotations

import torch

from moe_verify.spec import Stage, Trace


def slot_order(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """int64 [T, k] idx such that source.gather(1, idx) == target on every token whose two rows
    hold the same ids in some order (equal ids keep their order: the j-th of them to the j-th);
    the identity on every other token.

    source, target: integer [T, k] top-k ids (-1 slots included) on one device.
    """
    k = target.shape[1]
    identity = torch.arange(k, device=target.device).expand_as(target)
    s_sorted, s_pos = torch.sort(source.long(), dim=1, stable=True)
    t_sorted, t_pos = torch.sort(target.long(), dim=1, stable=True)
    same_set = (s_sorted == t_sorted).all(dim=1, keepdim=True)
    # target slot t_pos[:, r] holds the r-th smallest id, which source holds at s_pos[:, r]
    idx = torch.empty_like(t_pos).scatter_(1, t_pos, s_pos)
    return torch.where(same_set, idx, identity)


def aligned_slots(golden: Trace, other: Trace) -> Trace:
    """`other` with its per-slot tensors (moe_verify.spec `PER_SLOT_OUTPUTS`) in the golden's
    slot order, where its route lists some token's experts in another order; `other` itself
    where the orders agree or the routes cannot be aligned (a failed or missing route, another
    shape: route fails then)."""
    if any(Stage.ROUTE not in t or t.failure(Stage.ROUTE) is not None for t in (golden, other)):
        return other
    golden_ids, other_ids = golden[Stage.ROUTE]["topk_ids"], other[Stage.ROUTE]["topk_ids"]
    if not isinstance(other_ids, torch.Tensor) or other_ids.shape != golden_ids.shape:
        return other
    other_ids = other_ids.to(golden_ids.device)
    if torch.equal(other_ids.long(), golden_ids.long()):
        return other
    return other.in_slot_order(slot_order(other_ids, golden_ids))
