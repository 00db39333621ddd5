"""tolerance.contract: everything a backend legitimately returns keeps the stage contract (the
golden, the optimized path under the Triton interpreter in both modes, vLLM's adapter in the -m
vllm tier), and each rule fails on a correct trace with one output broken."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_one_stage
from moe_verify.spec import (
    GroupedLayout,
    MoEProblem,
    Recipe,
    Routing,
    ScaleFmt,
    Stage,
    Topology,
    Trace,
)
from moe_verify.sweep.cases import SMOKE, TOPOLOGY
from optimized import OptimizedBackend
from reference import ReferenceBackend
from reference.topology import placement
from tolerance.contract import contract_violations, local_expert_count

pytestmark = pytest.mark.cpu

F32, CEIL, PACKED = ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED


def tiny(**changes: object) -> MoEProblem:
    base = dict(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)
    return MoEProblem(**{**base, **changes})


def small(**changes: object) -> MoEProblem:
    """tiny with A = 32 (DeepGEMM's SM100 pick at small M): M_sum 160 instead of 640 keeps the
    interpreter's GEMMs short."""
    return tiny(**{"alignment": 32, **changes})


# Every recipe, scale format, grouped layout and topology a backend returns, on tiny shapes.
LEGIT: list[MoEProblem] = [
    tiny(),  # fp8_block, fp32 scales, m_indices (auto on a CPU), A = 128
    small(scale_fmt=CEIL),  # fp32 powers of two
    small(scale_fmt=PACKED),  # packed act scales, one word column: strides (1, round_up(M, 4))
    small(hidden=256, intermediate=256, recipe=Recipe.MXFP8, scale_fmt=PACKED),
    # ^ E8M0 bytes in, packed permuted and act scales with two word columns
    small(recipe=Recipe.MXFP4_W4A8, scale_fmt=CEIL),  # FP4 weights, fp32 act scales
    small(recipe=Recipe.MXFP4_W4A8, scale_fmt=PACKED),  # FP4 weights, packed act scales
    small(scale_fmt=CEIL, grouped_layout=GroupedLayout.PSUM),  # psum: expert_ends required
    small(scale_fmt=PACKED, grouped_layout=GroupedLayout.PSUM),  # psum with packed act scales
    small(grouped_layout=GroupedLayout.M_INDICES),  # the per-row layout, forced
    small(tokens=5, routing=Routing.INVALID_SLOTS),  # -1 slots, a token with none
    small(intermediate=256, topology=Topology.parse("tp:2")),  # I split: Ip = 128
    small(topology=Topology.parse("ep:2")),  # expert_map: E_l = 2
    small(topology=Topology.explicit_ep([[0, 1, 2], [2, 3, 0]])),  # replicas: E_l = 3 per rank
    tiny(topology=Topology.parse("ep:2+ht")),  # received tokens, int64 ids, exact M_sum, A = 128
    small(num_experts=3, topology=Topology.parse("ep:4+ht")),  # a rank with no expert, no token
    small(intermediate=256, topology=Topology.parse("ep:2+ll"), scale_fmt=CEIL),  # batched
    small(num_experts=3, topology=Topology.parse("ep:4+ll")),  # empty batches (E_l = 0)
    small(intermediate=256, topology=Topology.parse("ep:2"), shared_experts=1),  # shared stage
]


def _violations(problem: MoEProblem, trace: Trace, upstream_of: Callable[[str], Trace]) -> list:
    return [
        (trace.rank, stage, v)
        for stage in problem.stages
        for v in contract_violations(stage, problem, upstream_of(stage), trace[stage], trace.rank)
    ]


@pytest.mark.parametrize("problem", LEGIT, ids=lambda p: p.id)
def test_golden_keeps_the_contract(problem: MoEProblem) -> None:
    inputs = make_inputs(problem, "cpu")
    for rank in range(problem.topology.size):
        golden = ReferenceBackend().run(problem, inputs, rank)
        assert _violations(problem, golden, golden.upto) == []


@pytest.mark.parametrize("problem", LEGIT, ids=lambda p: p.id)
def test_optimized_keeps_the_contract_in_both_modes(problem: MoEProblem) -> None:
    """Isolated (each stage on the golden's upstream, as the runner feeds it) and chained."""
    _assert_keeps_the_contract(problem, lambda: OptimizedBackend(engine="triton"))


def _assert_keeps_the_contract(problem: MoEProblem, make_backend) -> None:
    """Every rank's isolated and chained trace of `make_backend()` has no violation."""
    inputs = make_inputs(problem, "cpu")
    for rank in range(problem.topology.size):
        golden = ReferenceBackend().run(problem, inputs, rank)
        backend = make_backend()
        isolated = Trace(backend.name, rank)
        for stage in problem.stages:
            isolated.add(
                stage, run_one_stage(backend, stage, problem, inputs, golden.upto(stage), rank)
            )
        assert _violations(problem, isolated, golden.upto) == []
        chained = backend.run(problem, inputs, rank)
        assert _violations(problem, chained, chained.upto) == []


# vLLM's DeepGemmExperts path covers fp8_block with A = 128 on the contiguous layout.
VLLM: list[MoEProblem] = [
    tiny(grouped_layout=GroupedLayout.M_INDICES),  # its permute's m_indices, colmajor act scales
    tiny(scale_fmt=PACKED, grouped_layout=GroupedLayout.PSUM),  # psum, packed act scales
    tiny(scale_fmt=CEIL, topology=Topology.parse("ep:2+ht")),  # exact M_sum from host counts
]


@pytest.mark.vllm
@pytest.mark.parametrize("problem", VLLM, ids=lambda p: p.id)
def test_vllm_adapter_keeps_the_contract(problem: MoEProblem) -> None:
    from moe_verify.adapters.vllm import VllmBackend

    _assert_keeps_the_contract(problem, lambda: VllmBackend(engine="triton"))


@pytest.mark.parametrize("problem", [*SMOKE, *TOPOLOGY], ids=lambda p: p.id)
def test_local_expert_count_is_the_golden_placement(problem: MoEProblem) -> None:
    hosts = placement(problem)
    counts = [local_expert_count(problem, r) for r in range(problem.topology.size)]
    assert counts == [len(h) for h in hosts]


# Breaking one output of a correct trace ---------------------------------------------------------

BASES: dict[str, MoEProblem] = {
    "fp32": tiny(),  # fp8_block, fp32 scales
    "packed": tiny(scale_fmt=PACKED),  # packed act scales, one word column
    "mx": tiny(hidden=256, intermediate=256, recipe=Recipe.MXFP8, scale_fmt=PACKED),  # two columns
    "psum": tiny(scale_fmt=CEIL, grouped_layout=GroupedLayout.PSUM),
    "ht": tiny(topology=Topology.parse("ep:2+ht")),
    "ll": tiny(intermediate=256, topology=Topology.parse("ep:2+ll")),
    "shared": tiny(intermediate=256, shared_experts=1),
}


@functools.cache
def golden_of(base: str) -> Trace:
    """Rank 0's golden trace of BASES[base] (read only: mutations work on copies of a stage)."""
    problem = BASES[base]
    return ReferenceBackend().run(problem, make_inputs(problem, "cpu"), 0)


Outputs = dict[str, object]


def _set(name: str, make: Callable[[torch.Tensor], object]) -> Callable[[Outputs], None]:
    def mutate(outs: Outputs) -> None:
        outs[name] = make(outs[name])

    return mutate


def _drop(name: str) -> Callable[[Outputs], None]:
    def mutate(outs: Outputs) -> None:
        del outs[name]

    return mutate


def _value(name: str, value: object) -> Callable[[Outputs], None]:
    def mutate(outs: Outputs) -> None:
        outs[name] = value

    return mutate


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the first dimension running fastest (a K-major tensor broken)."""
    return t.t().contiguous().t()


def _more_rows(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(5, *t.shape[1:])])


@dataclass(frozen=True)
class Mutation:
    id: str
    base: str
    stage: str
    mutate: Callable[[Outputs], None]
    expect: str  # the start of the violation that must name it


MUTATIONS: list[Mutation] = [
    # route
    Mutation("ids-int64", "fp32", "route", _set("topk_ids", lambda t: t.long()), "route.topk_ids dtype: expected torch.int32, got torch.int64"),  # noqa: E501
    Mutation("ids-one-k", "fp32", "route", _set("topk_ids", lambda t: t[:, :1]), "route.topk_ids shape: expected (T=4, k=2), got (4, 1)"),  # noqa: E501
    Mutation("weights-bf16", "fp32", "route", _set("topk_weights", lambda t: t.bfloat16()), "route.topk_weights dtype"),  # noqa: E501
    Mutation("weights-list", "fp32", "route", _set("topk_weights", lambda t: t.tolist()), "route.topk_weights type: expected a torch.Tensor, got list"),  # noqa: E501
    Mutation("ht-ids-int32", "ht", "route", _set("topk_ids", lambda t: t.int()), "route.topk_ids dtype: expected torch.int64"),  # noqa: E501
    Mutation("ht-more-than-T", "ht", "route", _set("topk_ids", _more_rows), "route.topk_ids shape: expected at most T=4"),  # noqa: E501
    Mutation("ht-token-index-missing", "ht", "route", _drop("token_index"), "route.token_index missing"),  # noqa: E501
    Mutation("ht-token-index-int32", "ht", "route", _set("token_index", lambda t: t.int()), "route.token_index dtype"),  # noqa: E501
    # quant_input
    Mutation("a1q-bf16", "fp32", "quant_input", _set("a1q", lambda t: t.bfloat16()), "quant_input.a1q dtype: expected torch.float8_e4m3fn, got torch.bfloat16"),  # noqa: E501
    Mutation("a1q-column-major", "fp32", "quant_input", _set("a1q", _column_major), "quant_input.a1q strides: expected contiguous"),  # noqa: E501
    Mutation("a1q-missing", "fp32", "quant_input", _drop("a1q"), "quant_input.a1q missing"),
    Mutation("a1q-scale-groups", "fp32", "quant_input", _set("a1q_scale", lambda t: t.repeat(1, 2)), "quant_input.a1q_scale shape: expected (M=4, H/128=1), got (4, 2)"),  # noqa: E501
    Mutation("mx-a1q-scale-fp32", "mx", "quant_input", _set("a1q_scale", lambda t: t.float()), "quant_input.a1q_scale dtype: expected torch.uint8, got torch.float32"),  # noqa: E501
    Mutation("recipe-int", "fp32", "quant_input", _value("recipe", 1), "quant_input.recipe type: expected a str"),  # noqa: E501
    # align
    Mutation("m-sum-float", "fp32", "align", _set("M_sum", float), "align.M_sum type: expected an int or a one-element integer tensor, got float"),  # noqa: E501
    Mutation("m-sum-bool", "fp32", "align", _value("M_sum", True), "align.M_sum type"),
    Mutation("m-sum-two-elements", "fp32", "align", _set("M_sum", lambda m: torch.tensor([m, m])), "align.M_sum type"),  # noqa: E501
    Mutation("m-sum-float-tensor", "fp32", "align", _set("M_sum", lambda m: torch.tensor(float(m))), "align.M_sum type"),  # noqa: E501
    Mutation("m-sum-missing", "fp32", "align", _drop("M_sum"), "align.M_sum missing"),
    Mutation("alignment-zero", "fp32", "align", _value("alignment", 0), "align.alignment value: expected >= 1, got 0"),  # noqa: E501
    Mutation("counts-int64", "fp32", "align", _set("counts", lambda t: t.long()), "align.counts dtype"),  # noqa: E501
    # permute
    Mutation("a-perm-rows", "fp32", "permute", _set("a_perm", lambda t: t[:-1]), "permute.a_perm rows: expected align's M_sum=640, or another multiple of A=128"),  # noqa: E501
    Mutation("a-perm-bf16", "fp32", "permute", _set("a_perm", lambda t: t.bfloat16()), "permute.a_perm dtype"),  # noqa: E501
    Mutation("a-perm-column-major", "fp32", "permute", _set("a_perm", _column_major), "permute.a_perm strides: expected unit stride along the last dimension"),  # noqa: E501
    Mutation("a-scale-perm-shape", "fp32", "permute", _set("a_scale_perm", lambda t: t[:-1]), "permute.a_scale_perm shape: expected (M_sum=640, H/128=1), got (639, 1)"),  # noqa: E501
    Mutation("mx-a-scale-perm-row-major", "mx", "permute", _set("a_scale_perm", lambda t: t.contiguous()), "permute.a_scale_perm strides: expected (1, 640)"),  # noqa: E501
    Mutation("mx-a-scale-perm-fp32", "mx", "permute", _set("a_scale_perm", lambda t: t.float()), "permute.a_scale_perm dtype: expected torch.int32"),  # noqa: E501
    Mutation("m-indices-int64", "fp32", "permute", _set("m_indices", lambda t: t.long()), "permute.m_indices dtype: expected torch.int32, got torch.int64"),  # noqa: E501
    Mutation("m-indices-strided", "fp32", "permute", _set("m_indices", lambda t: t.repeat(2)[::2]), "permute.m_indices strides: expected contiguous"),  # noqa: E501
    Mutation("inv-perm-flat", "fp32", "permute", _set("inv_perm", lambda t: t.reshape(-1)), "permute.inv_perm shape: expected (M=4, k=2), got (8,)"),  # noqa: E501
    Mutation("psum-expert-ends-missing", "psum", "permute", _drop("expert_ends"), "permute.expert_ends missing"),  # noqa: E501
    Mutation("expert-ends-shape", "fp32", "permute", _set("expert_ends", lambda t: t[:-1]), "permute.expert_ends shape: expected (E_l=4,), got (3,)"),  # noqa: E501
    Mutation("layout-value", "fp32", "permute", _value("layout", "rows"), "permute.layout value: expected one of ['m_indices', 'psum'], got 'rows'"),  # noqa: E501
    # dispatch (ep+ll)
    Mutation("a-batched-capacity", "ll", "dispatch", _set("a_batched", lambda t: t[:, :4]), "dispatch.a_batched shape: expected (E_l=2, max_tokens=128, H=128), got (2, 4, 128)"),  # noqa: E501
    Mutation("masked-m-int64", "ll", "dispatch", _set("masked_m", lambda t: t.long()), "dispatch.masked_m dtype"),  # noqa: E501
    Mutation("slot-missing", "ll", "dispatch", _drop("slot"), "dispatch.slot missing"),
    Mutation("expected-m-float", "ll", "dispatch", _value("expected_m", 1.5), "dispatch.expected_m type"),  # noqa: E501
    # gemm1
    Mutation("mm1-float32", "fp32", "gemm1", _set("mm1", lambda t: t.float()), "gemm1.mm1 dtype: expected torch.bfloat16, got torch.float32"),  # noqa: E501
    Mutation("mm1-missing", "fp32", "gemm1", _drop("mm1"), "gemm1.mm1 missing: expected torch.bfloat16 (M_sum=640, 2*Ip=256)"),  # noqa: E501
    Mutation("mm1-half-columns", "fp32", "gemm1", _set("mm1", lambda t: t[:, :128]), "gemm1.mm1 shape: expected (M_sum=640, 2*Ip=256), got (640, 128)"),  # noqa: E501
    Mutation("mm1-numpy", "fp32", "gemm1", _set("mm1", lambda t: t.float().numpy()), "gemm1.mm1 type: expected a torch.Tensor, got ndarray"),  # noqa: E501
    Mutation("engine-int", "fp32", "gemm1", _value("engine", 1), "gemm1.engine type: expected a str"),  # noqa: E501
    Mutation("ll-mm1-flat", "ll", "gemm1", _set("mm1", lambda t: t.reshape(-1, t.shape[-1])), "gemm1.mm1 shape: expected (E_l=2, max_tokens=128, 2*Ip=512)"),  # noqa: E501
    # act_quant
    Mutation("a2q-bf16", "fp32", "act_quant", _set("a2q", lambda t: t.bfloat16()), "act_quant.a2q dtype"),  # noqa: E501
    Mutation("a2q-column-major", "fp32", "act_quant", _set("a2q", _column_major), "act_quant.a2q strides"),  # noqa: E501
    Mutation("a2q-scale-groups", "fp32", "act_quant", _set("a2q_scale", lambda t: t.repeat(1, 2)), "act_quant.a2q_scale shape: expected (M_sum=640, Ip/128=1), got (640, 2)"),  # noqa: E501
    Mutation("packed-a2q-scale-fp32", "packed", "act_quant", _set("a2q_scale", lambda t: t.float()), "act_quant.a2q_scale dtype: expected torch.int32"),  # noqa: E501
    Mutation("packed-a2q-scale-one-column-dense", "packed", "act_quant", _set("a2q_scale", lambda t: t.reshape(-1).clone().view(t.shape)), "act_quant.a2q_scale strides: expected (1, 640)"),  # noqa: E501
    Mutation("mx-a2q-scale-row-major", "mx", "act_quant", _set("a2q_scale", lambda t: t.contiguous()), "act_quant.a2q_scale strides: expected (1, 640)"),  # noqa: E501
    Mutation("mx-a2q-scale-words", "mx", "act_quant", _set("a2q_scale", lambda t: t[:, :1]), "act_quant.a2q_scale shape: expected (M_sum=640, ceil(Ip/32/4)=2), got (640, 1)"),  # noqa: E501
    Mutation("ll-a2q-scale-fp64", "ll", "act_quant", _set("a2q_scale", lambda t: t.double()), "act_quant.a2q_scale dtype"),  # noqa: E501
    # gemm2, gather, shared
    Mutation("mm2-fp16", "fp32", "gemm2", _set("mm2", lambda t: t.half()), "gemm2.mm2 dtype: expected torch.bfloat16, got torch.float16"),  # noqa: E501
    Mutation("mm2-rows", "fp32", "gemm2", _set("mm2", lambda t: t[:128]), "gemm2.mm2 shape: expected (M_sum=640, H=128), got (128, 128)"),  # noqa: E501
    Mutation("out-float32", "fp32", "gather", _set("out", lambda t: t.float()), "gather.out dtype"),  # noqa: E501
    Mutation("ht-out-all-tokens", "ht", "gather", _set("out", _more_rows), "gather.out shape"),
    Mutation("shared-out-missing", "shared", "shared", _drop("out"), "shared.out missing"),
    Mutation("shared-out-rows", "shared", "shared", _set("out", lambda t: t[:1]), "shared.out shape: expected (T=4, H=128), got (1, 128)"),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: f"{m.stage}-{m.id}")
def test_each_rule_can_fail(m: Mutation) -> None:
    problem, golden = BASES[m.base], golden_of(m.base)
    outs = dict(golden[m.stage])
    assert contract_violations(m.stage, problem, golden.upto(m.stage), outs, 0) == []
    m.mutate(outs)
    found = contract_violations(m.stage, problem, golden.upto(m.stage), outs, 0)
    assert any(v.startswith(m.expect) for v in found), found


def test_extra_outputs_are_allowed() -> None:
    golden = golden_of("fp32")
    outs = {**golden["gemm1"], "engine_reason": "mine", "workspace": object()}
    assert contract_violations("gemm1", BASES["fp32"], golden.upto("gemm1"), outs, 0) == []


@pytest.mark.parametrize("recipe", ["exact_counts", "all_experts_bound"])
def test_a_permute_of_another_valid_m_sum_passes(recipe: str) -> None:
    """align's M_sum is one legitimate formula, the permute sized its buffer by another."""
    problem, golden = BASES["fp32"], golden_of("fp32")
    upstream = golden.upto("permute")
    align = dict(upstream["align"])
    align["M_sum"] = align["M_sum_recipes"][recipe]
    handed = Trace(golden.backend, golden.rank)
    for stage, outs in upstream.items():
        handed.add(stage, align if stage == Stage.ALIGN else outs)
    assert contract_violations("permute", problem, handed, golden["permute"], 0) == []


def test_m_sum_may_be_a_one_element_tensor() -> None:
    golden = golden_of("fp32")
    outs = {**golden["align"], "M_sum": torch.tensor([golden["align"]["M_sum"]])}
    assert contract_violations("align", BASES["fp32"], golden.upto("align"), outs, 0) == []


def test_outputs_that_are_not_a_mapping() -> None:
    golden = golden_of("fp32")
    found = contract_violations("gather", BASES["fp32"], golden.upto("gather"), [1], 0)
    assert found == ["gather outputs: expected a mapping of names to values, got list"]


def test_a_stage_the_problem_does_not_run_is_refused() -> None:
    golden = golden_of("fp32")
    with pytest.raises(ValueError, match=r"stage: expected one of .* got 'dispatch'"):
        contract_violations("dispatch", BASES["fp32"], golden.upto("gemm1"), {}, 0)


def test_a_rank_outside_the_topology_is_refused() -> None:
    golden = golden_of("ht")
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\) for ep2-ht, got 2"):
        contract_violations("gather", BASES["ht"], golden.upto("gather"), golden["gather"], 2)
