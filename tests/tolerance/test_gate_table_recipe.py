"""act_quant's hardware-gate recipes (packed_sm90_triton, colmajor_sm90_triton): offered where an
H200 gate table applies, equal to the plain recipe wherever the table equals torch's gate,
different where a case reaches an entry that differs, matched and named by the comparison, and
never chosen for the Triton interpreter's kernel (numpy's exp and an IEEE division: the plain
recipe).

The planted cases put (gate, up) pairs that reach a differing table entry (tests/tolerance/
gate_cases.py) into the live rows of the golden's mm1; the golden's act_quant is recomputed on
that upstream, so every act_quant here reads the same planted mm1 (isolated mode).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_one_stage
from moe_verify.run.sm90_chain import declare_hardware_gate
from moe_verify.spec import (
    Activation,
    ActQuantRecipe,
    MoEProblem,
    ScaleFmt,
    Stage,
    StageContext,
    Status,
)
from moe_verify.sweep.cases import SWIGLU
from optimized import triton_compat
from optimized.backend import OptimizedBackend
from optimized.triton_compat import interpreter_mode
from reference.activation import act_quant, sm90_triton_recipe
from reference.hardware.gate_table import gate_table_provenance, tabulated_alphas
from reference.moe import ReferenceBackend
from reference.recipes import act_quant_recipes
from tests.tolerance import gate_cases
from tests.tolerance.synthetic import replace_stage
from tolerance.compare import compare_stage

pytestmark = pytest.mark.cpu

R = ActQuantRecipe
BASE = MoEProblem(tokens=16, hidden=256, intermediate=256, num_experts=4, topk=2, alignment=32)


# -- which recipes apply ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Offer:
    label: str
    problem: MoEProblem
    recipes: tuple[ActQuantRecipe, ...]


LMD = R.COLMAJOR_AMAX_RECIPROCAL  # LMDeploy's, beside every colmajor rounding
SGL = R.PACKED_FAST_RECIPROCAL_SM90_CUDA  # SGLang's on an H200: float32 scales, silu
LMD_SM90 = R.COLMAJOR_AMAX_RECIPROCAL_SM90_TRITON  # LMDeploy's compiled twin, where a table is
OFFERS = [
    # plain silu: a table for alpha 1, both Triton roundings get their twin
    Offer("silu-float32", BASE, (R.COLMAJOR, R.COLMAJOR_SM90_TRITON, LMD, LMD_SM90, SGL)),
    # (and TensorRT-LLM's packed kernel for plain silu: no table, not a kernel recorded here)
    Offer(
        "silu-packed",
        BASE.replace(scale_fmt="ue8m0_packed"),
        (R.PACKED, R.PACKED_SM90_TRITON, R.COLMAJOR_CEIL_PACKED),
    ),  # fmt: skip
    # gpt-oss swigluoai (alpha 1.702, clamp 7, a bf16 value): tabulated
    Offer(
        "swigluoai-packed",
        BASE.replace(scale_fmt="ue8m0_packed", activation=SWIGLU),
        (R.PACKED, R.PACKED_SM90_TRITON),
    ),  # fmt: skip
    # an alpha no table was recorded for: the plain recipe only, silently
    Offer(
        "swigluoai-a1.5", BASE.replace(activation=Activation("swigluoai", 1.5)), (R.COLMAJOR, LMD)
    ),
    # packed clamps the gate in fp32: at 7.3 (not a bf16 value) the clamped gate has no entry
    Offer(
        "packed-L7.3", BASE.replace(scale_fmt="ue8m0_packed", activation="silu:L7.3"), (R.PACKED,)
    ),  # fmt: skip
    # colmajor rounds the clamped gate to bf16 first: the table still applies (SGLang's recipe
    # does not: it clamps at bf16(7.3), the golden at 7.3)
    Offer(
        "colmajor-L7.3",
        BASE.replace(activation="silu:L7.3"),
        (R.COLMAJOR, R.COLMAJOR_SM90_TRITON, LMD, LMD_SM90),
    ),  # fmt: skip
    # the low-latency layout: the twin, then vLLM's CUDA kernel (no table: not our kernel)
    Offer(
        "ll",
        BASE.replace(topology="ep:2+ll"),
        (R.COLMAJOR, R.COLMAJOR_SM90_TRITON, LMD, LMD_SM90, SGL, R.BF16_STEPS),
    ),  # fmt: skip
]


@pytest.mark.parametrize("offer", OFFERS, ids=lambda o: o.label)
def test_table_recipe_is_offered_where_a_table_applies(offer: Offer) -> None:
    assert act_quant_recipes(offer.problem) == offer.recipes


def test_tables_and_their_provenance() -> None:
    assert tabulated_alphas() == (1.0, 1.702)
    origin = gate_table_provenance()
    assert origin["gpu"] == "NVIDIA H200" and origin["triton"] == "3.6.0"
    assert origin["file"].endswith("sm90_triton_gate.safetensors")


def test_the_limits_used_keep_the_clamped_gate_on_the_bf16_grid() -> None:
    # The curated clamp (gpt-oss's 7.0) is a bf16 value, so min(g, limit) of a bf16 g is one.
    g = gate_cases.all_bf16()
    g = g[torch.isfinite(g)]
    clamped = torch.minimum(g, torch.tensor(SWIGLU.limit))
    assert torch.equal(clamped.to(torch.bfloat16).float(), clamped)


@pytest.mark.parametrize(
    ("recipe", "fmt", "activation", "match"),
    [
        (R.PACKED_SM90_TRITON, ScaleFmt.FLOAT32, Activation(), "packed UE8M0 scales"),
        (R.COLMAJOR_SM90_TRITON, ScaleFmt.UE8M0_PACKED, Activation(), "fp32 scales"),
        (R.COLMAJOR_SM90_TRITON, ScaleFmt.FLOAT32, Activation("swigluoai", 1.5), "no table"),
        (R.PACKED_SM90_TRITON, ScaleFmt.UE8M0_PACKED, Activation(limit=7.3), "not a bf16 value"),
    ],
    ids=["packed-fp32", "colmajor-packed", "untabulated-alpha", "off-grid-limit"],
)
def test_table_recipe_refuses_what_it_cannot_compute(
    recipe: ActQuantRecipe, fmt: ScaleFmt, activation: Activation, match: str
) -> None:
    mm1 = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        act_quant(mm1, activation, 128, fmt, recipe)


# -- the table recipe against the plain one ----------------------------------------------------


@dataclass(frozen=True)
class Case:
    label: str
    problem: MoEProblem

    @property
    def fused(self) -> ActQuantRecipe:
        packed = self.problem.scale_fmt is ScaleFmt.UE8M0_PACKED
        return R.PACKED if packed else R.COLMAJOR

    @property
    def twin(self) -> ActQuantRecipe:
        twin = sm90_triton_recipe(self.fused, self.problem.activation)
        assert twin is not None
        return twin


# Cases where a differing table entry reaches the fp8 codes or scales (gate_cases.differing_pairs;
# plain silu under colmajor has none: its bf16-rounded gate equals torch's for every input).
CASES = [
    Case("silu-packed", BASE.replace(scale_fmt="ue8m0_packed")),
    Case("swigluoai-packed", BASE.replace(scale_fmt="ue8m0_packed", activation=SWIGLU)),
    Case("swigluoai-float32", BASE.replace(activation=SWIGLU)),  # the one bf16-visible entry
    Case("swigluoai-ceil", BASE.replace(scale_fmt="float32_ceil_ue8m0", activation=SWIGLU)),
]
# Also plain silu colmajor, whose table recipe is bit-identical to the plain one everywhere.
RANDOM = [
    *CASES,
    Case("silu-float32", BASE),
    Case("silu-ceil", BASE.replace(scale_fmt="float32_ceil_ue8m0")),
]


@functools.cache
def golden(problem: MoEProblem) -> object:
    return ReferenceBackend().run(problem, make_inputs(problem), rank=0)


def live_rows(trace: object) -> list[int]:
    inv = trace[Stage.PERMUTE]["inv_perm"]
    return sorted({int(r) for r in inv[inv >= 0]})


@functools.cache
def planted_golden(case: Case) -> object:
    """The golden trace up to act_quant with differing pairs planted into live rows of mm1, and
    the golden's act_quant (every recipe) recomputed on it."""
    p = case.problem
    g = golden(p)
    pairs = gate_cases.differing_pairs(p.activation, p.scale_fmt)
    assert pairs, f"{case.label}: no table entry reaches the codes or scales"
    rows = live_rows(g)[: len(pairs)]
    mm1 = gate_cases.planted(g[Stage.GEMM1]["mm1"], rows, pairs, p.recipe.act_group)
    upstream = replace_stage(g.upto(Stage.ACT_QUANT), Stage.GEMM1, {**g[Stage.GEMM1], "mm1": mm1})
    act = ReferenceBackend().act_quant(StageContext(p, make_inputs(p), upstream, 0))
    upstream.add(Stage.ACT_QUANT, act)
    return upstream


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype.itemsize == 1 else x.view(torch.int32)


def group_hits(mm1: torch.Tensor, activation: Activation, group: int) -> torch.Tensor:
    """bool [M, I/group]: the group's (clamped) gate inputs reach a differing table entry."""
    gate = mm1[:, : mm1.shape[1] // 2].float()
    if activation.limit is not None:
        gate = torch.minimum(gate, torch.tensor(activation.limit))
    index = gate.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    hit = gate_cases.differing_entries(activation.alpha)[index]
    return hit.reshape(hit.shape[0], -1, group).any(-1)


@pytest.mark.parametrize("case", RANDOM, ids=lambda c: c.label)
def test_table_recipe_equals_plain_where_the_table_equals_torch(case: Case) -> None:
    p = case.problem
    mm1 = golden(p)[Stage.GEMM1]["mm1"]
    group = p.recipe.act_group
    plain = act_quant(mm1, p.activation, group, p.scale_fmt, case.fused)
    table = act_quant(mm1, p.activation, group, p.scale_fmt, case.twin)
    clean = ~group_hits(mm1, p.activation, group)
    codes = lambda q: bits(q).reshape(q.shape[0], -1, group)  # noqa: E731
    assert torch.equal(codes(plain[0])[clean], codes(table[0])[clean])
    if p.scale_fmt is not ScaleFmt.UE8M0_PACKED:
        assert torch.equal(bits(plain[1])[clean], bits(table[1])[clean])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_table_recipe_differs_on_the_planted_entries_only(case: Case) -> None:
    act = planted_golden(case)[Stage.ACT_QUANT]
    keys = act["recipe_outputs"][case.twin]
    q, q_table = bits(act["a2q"]), bits(act[keys["a2q"]])
    s, s_table = bits(act["a2q_scale"]), bits(act[keys["a2q_scale"]])
    differs = (q != q_table).any(1) | (s != s_table).any(1)
    pairs = gate_cases.differing_pairs(case.problem.activation, case.problem.scale_fmt)
    expected = set(live_rows(planted_golden(case))[: len(pairs)])
    assert set(differs.nonzero().squeeze(1).tolist()) == expected


# -- the comparison names the recipe the tested side computes --------------------------------------


def as_tested(case: Case, recipe: ActQuantRecipe, declare: bool = False) -> object:
    """The planted golden with act_quant replaced by `recipe`'s outputs (declared if asked)."""
    g = planted_golden(case)
    keys = g[Stage.ACT_QUANT]["recipe_outputs"][recipe]
    outs: dict[str, object] = {n: g[Stage.ACT_QUANT][k].clone() for n, k in keys.items()}
    if declare:
        outs["recipe"] = recipe.value
    return replace_stage(g, Stage.ACT_QUANT, outs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
@pytest.mark.parametrize("which", ["plain", "table"])
def test_each_recipe_is_matched_and_named(case: Case, which: str) -> None:
    recipe = case.fused if which == "plain" else case.twin
    result = compare_stage(
        Stage.ACT_QUANT, planted_golden(case), as_tested(case, recipe), case.problem
    )
    assert result.status is Status.PASS, result.checks
    assert result.recipe == recipe
    assert f"matches recipe {recipe}" in result.checks[0].detail


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_declared_table_recipe_computing_the_plain_one_is_held_to_it(case: Case) -> None:
    other = as_tested(case, case.fused)
    other[Stage.ACT_QUANT]["recipe"] = case.twin.value
    result = compare_stage(Stage.ACT_QUANT, planted_golden(case), other, case.problem)
    assert result.recipe == case.twin
    assert all("against the declared recipe" in c.detail for c in result.failed_checks)
    assert f"against the declared recipe {case.twin}" in result.checks[0].detail


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_interpreter_kernel_matches_the_plain_recipe(case: Case) -> None:
    """Under the interpreter the kernel's gate is an IEEE division of an exp, held here to
    torch's (numpy's float32 exp, the interpreter's own, varies with the CPU's vector unit and
    made the winner machine-dependent): the matcher picks the plain recipe, even on entries where
    the table recipe differs. Compiled on a GPU (the H200 the table was recorded on) the kernel
    reports its gate's Triton and capability, the harness declares the table recipe from them,
    and the kernel must match it bit for bit."""
    p = case.problem
    g = planted_golden(case)
    held = triton_compat.torch_exp_in_interpreter() if interpreter_mode() else nullcontext()
    with held:
        act = run_one_stage(
            OptimizedBackend(engine="triton"),
            Stage.ACT_QUANT,
            p,
            make_inputs(p),
            g.upto(Stage.ACT_QUANT),
            0,
        )
    other = replace_stage(g, Stage.ACT_QUANT, act)
    declare_hardware_gate(p, other)
    result = compare_stage(Stage.ACT_QUANT, g, other, p)
    assert result.status is Status.PASS, result.checks
    if interpreter_mode():
        assert "recipe" not in other[Stage.ACT_QUANT]  # no gate facts: nothing declared
        assert result.recipe == case.fused, result.checks[0].detail
    else:
        assert result.recipe == case.twin, result.checks[0].detail
        assert all(c.limit == 0 for c in result.checks), result.checks
