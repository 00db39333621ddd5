"""tolerance/stages/slots.py: a token's top-k slots matched by expert, not by position."""

from __future__ import annotations

import pytest
import torch

from tolerance.stages.slots import slot_order

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [
        ([[3, 1, 2, -1]], [[1, 2, 3, -1]], [[1, 2, 0, 3]]),  # a permutation, -1 kept in place
        ([[5, 5, 0, 1]], [[0, 5, 1, 5]], [[2, 0, 3, 1]]),  # duplicates: j-th to j-th
        ([[1, 2, 3, 4]], [[1, 2, 3, 4]], [[0, 1, 2, 3]]),  # the same order
        ([[3, 1, 2, -1]], [[1, 2, 4, -1]], [[0, 1, 2, 3]]),  # another set: identity
    ],
    ids=["permutation", "duplicates", "same", "other-set"],
)
def test_slot_order(source: list, target: list, expected: list) -> None:
    s, t = torch.tensor(source), torch.tensor(target)
    idx = slot_order(s, t)
    assert idx.tolist() == expected
    if expected != [[0, 1, 2, 3]] or source == target:
        assert torch.equal(s.gather(1, idx), t)


def test_slot_order_over_many_random_permutations() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, 6, (500, 8), generator=g)
    perm = torch.argsort(torch.rand(500, 8, generator=g), dim=1)
    shuffled = ids.gather(1, perm)
    assert torch.equal(ids.gather(1, slot_order(ids, shuffled)), shuffled)
