"""The one timer (moe_verify.common.timing) on a CPU: what it calls, what it returns, what it
refuses."""

from __future__ import annotations

import time

import pytest
import torch

from moe_verify.common import timing
from moe_verify.common.timing import capture_graph, median_seconds, timed_once

pytestmark = pytest.mark.cpu


def test_median_seconds_calls_the_warm_up_then_each_repeat() -> None:
    calls = []
    seconds = median_seconds(lambda: calls.append(time.sleep(0.001)), repeats=5, warmup=2)
    assert len(calls) == 7
    assert 0.001 <= seconds < 5.0


def test_median_seconds_is_the_median_not_the_mean() -> None:
    # One slow repeat among five moves a mean past 20 ms; the median stays with the fast ones.
    delays = iter([0.0, 0.1, 0.001, 0.001, 0.001, 0.001])
    seconds = median_seconds(lambda: time.sleep(next(delays)), repeats=5)
    assert seconds < 0.02


def test_median_seconds_refuses_no_repeats() -> None:
    with pytest.raises(ValueError, match="repeats"):
        median_seconds(lambda: None, repeats=0)


def test_capture_graph_refuses_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        capture_graph(lambda: None, torch.device("cpu"), calls=2)


def test_timed_once_returns_the_result_and_the_calls_seconds() -> None:
    calls = []
    out, seconds = timed_once(lambda: calls.append(time.sleep(0.05)) or "done")
    assert out == "done" and len(calls) == 1
    assert 0.05 <= seconds < 5.0


def test_phases_add_up_per_name_until_reset() -> None:
    timing.reset()
    for _ in range(2):
        with timing.phase("golden"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError), timing.phase("compare"):  # a raising block still counts
        raise RuntimeError("boom")
    seconds = timing.phase_seconds()
    assert set(seconds) == {"golden", "compare"} and 0.02 <= seconds["golden"] < 5.0
    timing.reset()
    assert timing.phase_seconds() == {}
