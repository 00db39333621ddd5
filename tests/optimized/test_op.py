"""CPU tier: the registered production op, torch.ops.moe_verify.fused_moe, on the Triton engine.

What vLLM ships is this op, not an eager call: so its registration (schema, mutated workspace,
layout tag, opcheck), a fake whose output metadata equals the real op's for every recipe, scale
format and layout, outputs bitwise equal to the production forward and within the golden's
tolerance, no host reads on the upper-bound paths (one on the exact-count path), bad workspaces
and backend names refused by name, and torch.compile(fullgraph=True): bitwise equal to eager, with
the TMA-aligned scale strides built inside the graph reaching the kernels unchanged.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_verify.production.host_reads import HostReads
from moe_verify.spec import (
    Engine,
    GroupedLayout,
    Mode,
    MoEProblem,
    Recipe,
    ScaleFmt,
    StageContext,
    Trace,
)
from optimized import OptimizedBackend, op, production
from optimized.production import Taps
from tests.optimized import op_calls
from tests.optimized.op_calls import OpCall
from tolerance.compare import compare

pytestmark = pytest.mark.cpu

FP8, MXFP8, MXFP4 = Recipe.FP8_BLOCK, Recipe.MXFP8, Recipe.MXFP4_W4A8
F32, CEIL, PACKED = ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED
M_INDICES, PSUM = GroupedLayout.M_INDICES, GroupedLayout.PSUM


@dataclass(frozen=True)
class OpCase:
    """One rank-0 call of the op on a tiny problem (tokens=8, H=I=128, E=4, k=2)."""

    recipe: Recipe
    scale_fmt: ScaleFmt
    topology: str = "tp:1"
    layout: GroupedLayout = M_INDICES
    hidden: int = 128

    @property
    def id(self) -> str:
        # ep+ll runs the batched layout whatever the grouped layout says.
        layout = "" if "ll" in self.topology else f"-{self.layout.value}"
        topology = self.topology.replace(":", "")
        return f"{self.recipe.value}-{self.scale_fmt.value}-{topology}{layout}-H{self.hidden}"

    def problem(self) -> MoEProblem:
        return MoEProblem(
            tokens=8,
            hidden=self.hidden,
            intermediate=128,
            num_experts=4,
            topk=2,
            recipe=self.recipe,
            scale_fmt=self.scale_fmt,
            topology=self.topology,
            grouped_layout=GroupedLayout.AUTO if "ll" in self.topology else self.layout,
            seed=zlib.crc32(self.id.encode()),
        )


def op_call(case: OpCase) -> OpCall:
    return op_calls.op_call(case.problem(), Engine.TRITON)


# Every (recipe, scale format) the problem allows, on each layout it can run.
FAKE_CASES = [
    OpCase(FP8, F32),
    OpCase(FP8, CEIL),
    OpCase(FP8, PACKED),
    OpCase(MXFP8, PACKED),
    OpCase(MXFP4, CEIL),
    OpCase(MXFP4, PACKED),
    OpCase(FP8, F32, layout=PSUM),
    OpCase(FP8, CEIL, layout=PSUM),
    OpCase(FP8, PACKED, layout=PSUM),
    OpCase(FP8, F32, "ep:2+ll"),  # batched (masked) layout, fp32 scales
    OpCase(FP8, CEIL, "ep:2+ll"),  # batched layout, power-of-two scales
    OpCase(FP8, F32, "ep:2+ht"),  # exact-count path: M_sum from the counts
    OpCase(MXFP4, PACKED, "ep:2+ht"),  # exact-count path, E2M1 weights
]


def _params(cases: list[OpCase]) -> list[object]:
    return [pytest.param(c, id=c.id) for c in cases]


# -- registration --------------------------------------------------------------------------------


def test_op_is_registered_with_its_mutation_and_layout_tag() -> None:
    overload = torch.ops.moe_verify.fused_moe.default
    written = [a.name for a in overload._schema.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["workspace"], f"{op.OP_NAME}: mutated arguments {written}, want workspace"
    # needs_exact_strides, not needs_fixed_stride_order: the latter keeps only the order of a
    # scale's strides, and Inductor then drops its TMA padding (see the last two tests here).
    assert torch.Tag.needs_exact_strides in overload.tags, f"{op.OP_NAME} tags: {overload.tags}"


def test_opcheck() -> None:
    call = op_call(OpCase(FP8, F32))
    # test_schema is left out: its SchemaCheckMode compares inputs before and after with
    # torch.allclose, which the CPU does not implement for float8_e4m3fn (the weights).
    # test_op_mutates_only_its_workspace below checks the same thing bytewise.
    torch.library.opcheck(
        torch.ops.moe_verify.fused_moe.default,
        call.args(call.workspace()),
        op.op_args(call.cfg),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


def test_op_mutates_only_its_workspace() -> None:
    call = op_call(OpCase(FP8, F32))
    ws = call.workspace().fill_(0xFF)
    args = call.args(ws)
    names = [a.name for a in torch.ops.moe_verify.fused_moe.default._schema.arguments]
    before = {n: _bytes(a) for n, a in zip(names, args, strict=False) if a is not None}
    call.run(workspace=ws)
    after = {n: _bytes(a) for n, a in zip(names, args, strict=False) if a is not None}
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed == ["workspace"], f"arguments the op wrote: {changed}; declared: workspace"


# -- the fake against the real op ----------------------------------------------------------------


def _metadata(t: torch.Tensor) -> tuple[object, ...]:
    return tuple(t.shape), t.dtype, t.stride(), t.device


@pytest.mark.parametrize("case", _params(FAKE_CASES))
def test_fake_matches_real(case: OpCase) -> None:
    call = op_call(case)
    real = call.run()
    mode = FakeTensorMode()
    args = [
        mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
        for a in call.args(call.workspace())
    ]
    with mode:
        fake = torch.ops.moe_verify.fused_moe(*args, **op.op_args(call.cfg))
    assert _metadata(fake) == _metadata(real), (
        f"{case.id}: fake (shape, dtype, strides, device) {_metadata(fake)}, real {_metadata(real)}"
    )


# -- the op against the forward and the golden ---------------------------------------------------

GOLDEN_CASES = [
    OpCase(FP8, F32),  # m_indices, fp32 scales
    OpCase(FP8, PACKED, layout=PSUM),  # psum, packed E8M0 activation scales
    OpCase(MXFP4, CEIL),  # E2M1 weights
    OpCase(FP8, CEIL, "ep:2+ll"),  # batched layout
    OpCase(FP8, F32, "ep:2+ht"),  # exact-count path
]


@pytest.mark.parametrize("case", _params(GOLDEN_CASES))
def test_op_equals_the_forward_and_passes_the_golden(case: OpCase) -> None:
    call = op_call(case)
    taps: Taps = {}
    with op.recording(taps):
        out = call.run()
    direct = production.forward(
        OptimizedBackend(), call.cfg, call.hidden_states, call.topk_ids, call.topk_weights,
        call.weights, call.workspace(),
    )  # fmt: skip
    assert torch.equal(out.view(torch.int16), direct.view(torch.int16)), (
        f"{case.id}: the op's output differs from production.forward's"
    )
    trace = Trace("production")
    for stage, outputs in taps.items():
        trace.add(stage, outputs)
    if "token_index" in call.golden["route"]:
        trace["route"]["token_index"] = call.golden["route"]["token_index"]
    stages = [s for s in call.problem.stages if s != "route"]
    results = compare(call.golden, trace, call.problem, stages, mode=Mode.CHAINED)
    failed = [r for r in results if r.status.value != "pass"]
    assert not failed, f"{case.id}: " + "\n".join(str(r) for r in failed)


# -- host syncs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    _params([
        OpCase(FP8, F32),  # tp: M_sum from the token bound
        OpCase(FP8, F32, "ep:2"),  # ep: expert map, ids of other ranks skipped
        OpCase(FP8, F32, "ep:2+ll"),  # batched dispatch, masked_m on the device
        OpCase(FP8, F32, "ep:2+ht"),  # exact-count path: reads the counts once
    ]),
)  # fmt: skip
def test_host_reads_per_call(case: OpCase) -> None:
    call = op_call(case)
    ws = call.workspace()
    with HostReads().counting() as detector:
        call.run(workspace=ws)
    assert len(detector.reads) == call.cfg.host_syncs, (
        f"{case.id}: {len(detector.reads)} host reads {detector.reads} in one call, "
        f"ForwardConfig.host_syncs says {call.cfg.host_syncs}"
    )


_READ_BACKS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "bool": lambda t: bool(t.sum() > 0),
    "int": lambda t: int(t.sum()),
    "float": lambda t: float(t.sum()),
    "index": lambda t: [0, 1][t.sum().long().clamp(0, 1)],
    "nonzero": lambda t: t.nonzero(),
    "unique": lambda t: t.unique(),
    "where_cond": lambda t: torch.where(t > 0),
    "mask_index": lambda t: t[t > 0],
    "repeat_interleave": lambda t: torch.repeat_interleave(t, t.long().clamp(0, 2)),
}


class ReadsBack(OptimizedBackend):
    """The optimized path, its gather reading the routing weights back once (the way `read`
    says): the detector must count that one read inside the op, and blame gather."""

    name = "reads_back"

    def __init__(self, read: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        self.read = read

    def gather(self, ctx: StageContext) -> dict[str, object]:
        upstream = ctx.upstream
        self.read(upstream["route"]["topk_weights"].flatten())
        return super().gather(ctx)


@pytest.mark.parametrize("how", list(_READ_BACKS))
def test_the_detector_counts_a_read_inside_the_op(how: str) -> None:
    call = op_call(OpCase(FP8, F32))
    name = op.register_backend(ReadsBack(_READ_BACKS[how]))
    with HostReads().counting() as detector:
        call.run(backend=name)
    assert len(detector.reads) == 1, f"{how}: counted {detector.reads}, want one read"
    assert list(detector.by_stage()) == ["gather"], f"{how}: blamed {detector.by_stage()}"


# -- bad input -----------------------------------------------------------------------------------


def test_refuses_a_too_small_workspace() -> None:
    call = op_call(OpCase(FP8, F32))
    need = call.workspace().numel()
    with pytest.raises(
        ValueError, match=f"workspace has {need - 1} bytes but this call needs {need}"
    ):
        call.run(workspace=call.workspace()[: need - 1])


def test_refuses_a_workspace_of_the_wrong_dtype() -> None:
    call = op_call(OpCase(FP8, F32))
    ws = call.workspace().view(torch.int32)
    with pytest.raises(ValueError, match="workspace must be a uint8 tensor, got torch.int32"):
        call.run(workspace=ws)


def test_refuses_an_unknown_backend() -> None:
    call = op_call(OpCase(FP8, F32))
    with pytest.raises(ValueError, match="no backend named 'no_such_backend'.*known"):
        call.run(backend="no_such_backend")


def test_register_refuses_what_is_not_a_backend() -> None:
    with pytest.raises(TypeError, match=r"is not a backend: it lacks name \(a str\)"):
        op.register_backend(object())  # type: ignore[arg-type]


# -- torch.compile -------------------------------------------------------------------------------


class RecordsScaleStrides(OptimizedBackend):
    """The optimized path, recording the strides of the w13 scale its gemm1 received (in
    production mode: the scale the op was given)."""

    name = "records_scale_strides"

    def __init__(self) -> None:
        super().__init__()
        self.strides: list[tuple[int, ...]] = []

    def gemm1(self, ctx: StageContext) -> dict[str, object]:
        self.strides.append(ctx.shard.w13.scale.stride())
        return super().gemm1(ctx)


RECORDER = RecordsScaleStrides()
op.register_backend(RECORDER)


def mn_major_tma_aligned(scale: torch.Tensor) -> torch.Tensor:
    """scale [E, N, K] copied MN-major with N padded to 4 (16 bytes of fp32): strides
    (K * round_up(N, 4), 1, round_up(N, 4)), DeepGEMM's TMA-aligned scale layout."""
    e, n, k = scale.shape
    padded = -(-n // 4) * 4
    out = torch.empty((e, k, padded), dtype=scale.dtype, device=scale.device)
    return out[:, :, :n].transpose(1, 2).copy_(scale)


class RankMoE(torch.nn.Module):
    """One rank's MoE layer as a model holds it: weights and workspace as buffers, the op in
    forward. The w13 scale is re-laid out MN-major TMA-aligned inside forward, so under
    torch.compile the tensor handed to the op is one Inductor allocated."""

    def __init__(self, call: OpCall, fused_moe: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fused_moe = fused_moe
        self.kwargs = op.op_args(call.cfg, RECORDER.name)
        w = call.weights
        for name, t in (("w13", w.w13.q), ("w13_scale", w.w13_scale), ("w2", w.w2.q),
                        ("w2_scale", w.w2_scale), ("expert_map", w.expert_map),
                        ("workspace", call.workspace())):  # fmt: skip
            self.register_buffer(name, t)

    def forward(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.fused_moe(
            hidden_states, topk_ids, topk_weights, self.w13, mn_major_tma_aligned(self.w13_scale),
            self.w2, self.w2_scale, self.expert_map, self.workspace, **self.kwargs,
        )  # fmt: skip


@dataclass(frozen=True)
class Compiled:
    eager: torch.Tensor
    compiled: torch.Tensor
    eager_strides: tuple[int, ...]
    compiled_strides: tuple[int, ...]
    padded_strides: tuple[int, ...]


# H=256: the w13 scale is [E, 2, 2], so the padding (N=2 -> 4) shows in both strides.
COMPILE_CASE = OpCase(FP8, F32, hidden=256)


def compile_and_run(fused_moe: Callable[..., torch.Tensor]) -> Compiled:
    call = op_call(COMPILE_CASE)
    model = RankMoE(call, fused_moe)
    inputs = (call.hidden_states, call.topk_ids, call.topk_weights)
    RECORDER.strides.clear()
    eager = model(*inputs)
    # Inductor's FX graph cache keys on the graph, not on the ops' layout tags (torch 2.13): a
    # graph compiled under another tag would be replayed, so these compiles never touch it.
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        compiled = torch.compile(model, fullgraph=True, backend="inductor")(*inputs)
    e, n, k = call.weights.w13_scale.shape
    padded = -(-n // 4) * 4
    eager_strides, compiled_strides = RECORDER.strides
    return Compiled(eager, compiled, eager_strides, compiled_strides, (k * padded, 1, padded))


def test_compiled_op_equals_eager_and_keeps_the_tma_aligned_scale_strides() -> None:
    """One compile (the slow part on the CPU) for both checks."""
    run = compile_and_run(torch.ops.moe_verify.fused_moe)
    assert torch.equal(run.compiled.view(torch.int16), run.eager.view(torch.int16)), (
        "compiled and eager outputs differ"
    )
    assert run.eager_strides == run.padded_strides
    assert run.compiled_strides == run.eager_strides, (
        f"w13_scale strides inside the op: compiled {run.compiled_strides}, eager "
        f"{run.eager_strides} (MN-major, N padded to 4 for TMA)"
    )


# The same op under needs_fixed_stride_order, vLLM's default tag for its custom ops.
_TEST_LIB = torch.library.Library("moe_verify_test", "FRAGMENT")
_FIXED_ORDER = "fused_moe_fixed_stride_order"
_TEST_LIB.define(
    _FIXED_ORDER + str(torch.ops.moe_verify.fused_moe.default._schema).removeprefix(op.OP_NAME),
    tags=(torch.Tag.needs_fixed_stride_order,),
)
_TEST_LIB.impl(_FIXED_ORDER, torch.ops.moe_verify.fused_moe.default, "CompositeExplicitAutograd")
torch.library.register_fake(
    f"moe_verify_test::{_FIXED_ORDER}", torch.ops.moe_verify.fused_moe.default, lib=_TEST_LIB
)


def test_fixed_stride_order_alone_drops_the_tma_padding() -> None:
    """Why the op carries needs_exact_strides, and proof the stride check can fail: under
    needs_fixed_stride_order Inductor keeps the MN-major order but allocates the scale densely,
    the TMA padding gone (vLLM #49928: (1, align(M, 4)) -> (1, M), and DeepGEMM read past it)."""
    run = compile_and_run(torch.ops.moe_verify_test.fused_moe_fixed_stride_order)
    assert torch.equal(run.compiled.view(torch.int16), run.eager.view(torch.int16))
    assert run.eager_strides == run.padded_strides
    assert run.compiled_strides != run.eager_strides, (
        f"Inductor kept {run.compiled_strides} under needs_fixed_stride_order: the stride test "
        "above no longer shows that the exact-strides tag is needed"
    )
