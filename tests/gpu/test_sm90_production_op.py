"""SM90 tier: the registered production op on the DeepGEMM engine, as vLLM runs it.

The fake's output metadata equals the real op's; the op equals production.forward bitwise and
passes the golden; the upper-bound paths make no host sync (torch's sync debug mode raises on
one); a CUDA-graph capture replays bitwise equal to eager, also after new routing is copied into
its static inputs; torch.compile(fullgraph=True) equals eager bitwise.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_verify.spec import Engine, GroupedLayout, Mode, MoEProblem, Recipe, ScaleFmt, Trace
from optimized import OptimizedBackend, op, production
from optimized.production import Taps
from tests.optimized.op_calls import OpCall, op_call
from tolerance.compare import compare

pytestmark = pytest.mark.sm90


@dataclass(frozen=True)
class GpuCase:
    """Rank 0 of a DeepGEMM-legal problem (H, I multiples of 128), the engine forced."""

    scale_fmt: ScaleFmt
    topology: str = "tp:1"
    layout: GroupedLayout = GroupedLayout.PSUM

    @property
    def id(self) -> str:
        layout = "" if "ll" in self.topology else f"-{self.layout.value}"
        return f"fp8_block-{self.scale_fmt.value}-{self.topology.replace(':', '')}{layout}"

    def problem(self, seed_offset: int = 0) -> MoEProblem:
        return MoEProblem(
            tokens=64,
            hidden=512,
            intermediate=512,
            num_experts=8,
            topk=2,
            recipe=Recipe.FP8_BLOCK,
            scale_fmt=self.scale_fmt,
            topology=self.topology,
            grouped_layout=GroupedLayout.AUTO if "ll" in self.topology else self.layout,
            seed=zlib.crc32(self.id.encode()) + seed_offset,
        )


CASES = [
    GpuCase(ScaleFmt.FLOAT32, layout=GroupedLayout.PSUM),
    GpuCase(ScaleFmt.FLOAT32, layout=GroupedLayout.M_INDICES),
    GpuCase(ScaleFmt.FLOAT32_CEIL_UE8M0, layout=GroupedLayout.PSUM),
    GpuCase(ScaleFmt.FLOAT32_CEIL_UE8M0, layout=GroupedLayout.M_INDICES),
    GpuCase(ScaleFmt.FLOAT32, "ep:2+ll"),  # masked GEMMs on the batched layout
    GpuCase(ScaleFmt.FLOAT32_CEIL_UE8M0, "ep:2+ll"),
]
PARAMS = [pytest.param(c, id=c.id) for c in CASES]


def gpu_call(case: GpuCase, seed_offset: int = 0) -> tuple[OpCall, torch.Tensor]:
    """The op's call on DeepGEMM and one workspace for all of a test's runs (a CUDA graph
    replays into the buffers it was captured with)."""
    call = op_call(case.problem(seed_offset), Engine.DEEPGEMM, "cuda")
    return call, call.workspace()


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _metadata(t: torch.Tensor) -> tuple[object, ...]:
    return tuple(t.shape), t.dtype, t.stride(), t.device


@pytest.mark.parametrize("case", PARAMS)
def test_fake_matches_real(case: GpuCase) -> None:
    call, ws = gpu_call(case)
    real = call.run(workspace=ws)
    mode = FakeTensorMode()
    args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in call.args(ws)]
    with mode:
        fake = torch.ops.moe_verify.fused_moe(*args, **op.op_args(call.cfg))
    assert _metadata(fake) == _metadata(real), (
        f"{case.id}: fake {_metadata(fake)}, real {_metadata(real)}"
    )


@pytest.mark.parametrize("case", PARAMS)
def test_op_equals_the_forward_and_passes_the_golden(case: GpuCase) -> None:
    call, ws = gpu_call(case)
    taps: Taps = {}
    with op.recording(taps):
        out = call.run(workspace=ws)
    direct = production.forward(
        OptimizedBackend(), call.cfg, call.hidden_states, call.topk_ids, call.topk_weights,
        call.weights, torch.empty_like(ws),
    )  # fmt: skip
    assert _bitwise_equal(out, direct), f"{case.id}: op and production.forward differ"
    trace = Trace("production")
    for stage, outputs in taps.items():
        trace.add(stage, outputs)
    stages = [s for s in call.problem.stages if s != "route"]
    results = compare(call.golden, trace, call.problem, stages, mode=Mode.CHAINED)
    failed = [r for r in results if r.status.value != "pass"]
    assert not failed, f"{case.id}: " + "\n".join(str(r) for r in failed)


@contextlib.contextmanager
def syncs_raise() -> Iterator[None]:
    """torch raises on any synchronizing CUDA call made inside (a D2H copy, item(), nonzero)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("case", PARAMS)
def test_no_host_syncs(case: GpuCase) -> None:
    call, ws = gpu_call(case)
    assert call.cfg.host_syncs == 0
    call.run(workspace=ws)  # warm-up: DeepGEMM JIT-compiles its kernels on first use
    with syncs_raise():
        call.run(workspace=ws)
    torch.cuda.synchronize()


def test_the_sync_check_raises_on_a_sync() -> None:
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), syncs_raise():
        x.sum().item()


@pytest.mark.parametrize("case", PARAMS)
def test_cuda_graph_replay_equals_eager(case: GpuCase) -> None:
    call, ws = gpu_call(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call.run(workspace=ws)  # warm-up outside the capture (DeepGEMM JIT, allocator pools)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call.run(workspace=ws)
    graph.replay()
    eager = call.run(workspace=ws)
    assert _bitwise_equal(static_out, eager), f"{case.id}: replay differs from eager"
    # New routing (another seed's) copied into the captured inputs: the replay must follow it.
    other, _ = gpu_call(case, seed_offset=1)
    for static, new in ((call.hidden_states, other.hidden_states),
                        (call.topk_ids, other.topk_ids),
                        (call.topk_weights, other.topk_weights)):  # fmt: skip
        static.copy_(new)
    graph.replay()
    eager = call.run(workspace=ws)
    assert _bitwise_equal(static_out, eager), f"{case.id}: replay with new routing differs"


class RankMoE(torch.nn.Module):
    """One rank's weights and workspace as buffers, the op in forward."""

    def __init__(self, call: OpCall, workspace: torch.Tensor) -> None:
        super().__init__()
        self.kwargs = op.op_args(call.cfg)
        w = call.weights
        for name, t in (("w13", w.w13.q), ("w13_scale", w.w13_scale), ("w2", w.w2.q),
                        ("w2_scale", w.w2_scale), ("expert_map", w.expert_map),
                        ("workspace", workspace)):  # fmt: skip
            self.register_buffer(name, t)

    def forward(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.moe_verify.fused_moe(
            hidden_states, topk_ids, topk_weights, self.w13, self.w13_scale, self.w2,
            self.w2_scale, self.expert_map, self.workspace, **self.kwargs,
        )  # fmt: skip


@pytest.mark.parametrize("case", [PARAMS[0], PARAMS[4]])
def test_compiled_equals_eager(case: GpuCase) -> None:
    call, ws = gpu_call(case)
    model = RankMoE(call, ws)
    inputs = (call.hidden_states, call.topk_ids, call.topk_weights)
    eager = model(*inputs)
    compiled = torch.compile(model, fullgraph=True)(*inputs)
    assert _bitwise_equal(compiled, eager), f"{case.id}: compiled and eager outputs differ"
