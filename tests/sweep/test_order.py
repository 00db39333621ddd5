"""The sweep pool's dispatch: the largest pre-flight estimate first, and a case that does not fit
its device yet lets the smaller ones behind it start (moe_verify/sweep/pool.py)."""

from __future__ import annotations

import pytest

from moe_verify.spec import MoEProblem
from moe_verify.sweep.pool import Device, RunningCase, dispatch_order, take_next

pytestmark = pytest.mark.cpu


def _running(estimate: int) -> RunningCase:
    return RunningCase(0, MoEProblem(), 0.0, None, None, estimate)


def test_the_largest_estimate_goes_first_and_ties_keep_case_order() -> None:
    assert dispatch_order([10, 50, 30, 50, 10]) == [1, 3, 2, 0, 4]
    assert dispatch_order([]) == []


def test_a_case_that_does_not_fit_yet_lets_a_smaller_one_start() -> None:
    device = Device(None, budget=100)
    queue = dispatch_order([70, 60, 20])  # [0, 1, 2]
    assert take_next(queue, [70, 60, 20], device) == 0
    first = _running(70)
    device.take(first)
    # 60 does not fit beside 70 in 100; 20 does
    assert take_next(queue, [70, 60, 20], device) == 2
    device.take(_running(20))
    assert take_next(queue, [70, 60, 20], device) is None
    assert queue == [1]
    device.release(first)
    assert take_next(queue, [70, 60, 20], device) == 1
    assert queue == []


def test_a_case_alone_on_its_device_always_starts() -> None:
    device = Device(None, budget=10)
    queue = [0]
    assert take_next(queue, [500], device) == 0
