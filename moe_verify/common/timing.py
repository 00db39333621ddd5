"""The suite's one way to time a call: `bench`, `bench --production` and the GPU measurement
scripts all read their numbers here, so two tables never disagree because their timers did.

- `median_seconds`: the median of repeats after a warm-up, with CUDA events on a GPU (they time
  the stream, not the host's launch loop) and perf_counter on a CPU.
- `replay_seconds`: the same median of a CUDA graph's replays, the call captured several times
  back to back and the time divided by the calls (a replay's own launch cost is paid once per
  model graph in vLLM, not once per call).
- `timed_once`: one call's wall seconds, compile or JIT included, with its result.
- `phase`: where a verified case's time goes, wall seconds per phase of `verify` (making the
  inputs, the golden, the tested side per mode, the golden's SM90 tensor-core GEMMs and chain,
  the comparison), summed over ranks; a sweep keeps them per case (summary.json
  `phase_seconds`, docs/ci.md), so a slow CI run shows what to cut. Phases do not nest, and the
  stages sync the GPU as they end (moe_verify/run/runner.py), so a kernel's time falls in its own
  phase.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of one call of `fn` over `repeats` calls, after `warmup` untimed calls
    (a first call's compile, JIT or allocator growth is not what a repeat costs)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def capture_graph(
    fn: Callable[[], object], device: torch.device, calls: int
) -> torch.cuda.CUDAGraph:
    """`calls` calls of `fn` captured back to back in one CUDA graph on `device`, after one
    warm-up call on a side stream (JIT compiles and allocator growth happen outside the capture,
    as torch.cuda.graph requires)."""
    if device.type != "cuda":
        raise ValueError(f"a CUDA graph needs a CUDA device, got {device}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def replay_seconds(
    fn: Callable[[], object], device: torch.device, repeats: int, calls: int
) -> float:
    """Median seconds of one call of `fn` when replayed from a CUDA graph: `calls` calls are
    captured in one graph and each replay's time is divided by them."""
    graph = capture_graph(fn, device, calls)
    return median_seconds(graph.replay, repeats) / calls


def timed_once(fn: Callable[[], T]) -> tuple[T, float]:
    """`fn`'s result and the wall seconds of this one call, the GPU (if any) synchronized before
    and after: a first call's compile or JIT counts, as a measurement script wants to report."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


_phases: dict[str, float] = {}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the wall time inside the block to phase `name` of the case's account."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _phases[name] = _phases.get(name, 0.0) + time.perf_counter() - start


def reset() -> None:
    """Start a new case's account."""
    _phases.clear()


def phase_seconds() -> dict[str, float]:
    """The account since `reset`, in milliseconds' precision."""
    return {name: round(seconds, 3) for name, seconds in _phases.items()}
