"""The sm90 tier's DeepGEMM GEMM shapes stay few (checked on the CPU, from the tier's case lists).

Each distinct (N, K, local experts) DeepGEMM runs is a JIT compile, about 9 s on the H200 on a
cold cache, and `pytest tests/gpu -m sm90` must finish cold in minutes. The tests that force
DeepGEMM on made-up problems share one shape (moe_verify/sweep/cases.py GPU_SHAPE); the
others are the model shapes vLLM runs (DeepSeek-V3 EP8-local, Qwen3) and one K edge (H = 3584).
"""

from __future__ import annotations

import pytest

from moe_verify.spec import MoEProblem, Recipe
from moe_verify.sweep.cases import GPU_SHAPE
from moe_verify.sweep.nightly import gemm_shapes
from tests.gpu import (
    test_sm90_compare_device,
    test_sm90_graph,
    test_sm90_pipeline,
    test_sm90_production_op,
    test_sm90_tensor_core_fused,
)

pytestmark = pytest.mark.cpu

# GPU_SHAPE's four GEMMs (gemm1 and gemm2, on 8 and 4 experts per rank) + DeepSeek-V3 EP8-local
# (2) + Qwen3 (2) + H = 3584 (2).
MAX_SHAPES = 10
SHARED = gemm_shapes(
    [
        MoEProblem(tokens=128, topk=2, **GPU_SHAPE),
        MoEProblem(tokens=128, topk=2, topology="ep:2", **GPU_SHAPE),
    ]
)


def _made_up() -> list[MoEProblem]:
    """The problems the tier runs DeepGEMM on to test something other than a model's shape."""
    return [
        *test_sm90_pipeline.LL_CASES,
        *test_sm90_pipeline.LAYOUT_CASES,
        *test_sm90_graph.DEEPGEMM,
        *(test_sm90_graph.GPU.replace(topology=c.topology) for c in test_sm90_graph.CATCHES),
        *(c.problem() for c in test_sm90_production_op.CASES),
    ]


def test_made_up_problems_share_one_shape() -> None:
    assert gemm_shapes(_made_up()) <= SHARED, sorted(gemm_shapes(_made_up()) - SHARED)


def test_the_tier_compiles_few_shapes() -> None:
    problems = [
        *(p for p in test_sm90_pipeline.CASES if p.recipe is Recipe.FP8_BLOCK),
        *_made_up(),
        *(p for p, engine in test_sm90_compare_device.CORRECT if engine == "auto"),
        test_sm90_tensor_core_fused.DSV3,
    ]
    shapes = gemm_shapes(problems)
    assert len(shapes) <= MAX_SHAPES, sorted(shapes)


def test_the_pipeline_leaves_the_nightlys_rows_to_it() -> None:
    """The DeepSeek-V3 rows the nightly runs at the same size (T = 1, 128, 4096) are not run
    twice; the rest of the pipeline preset is."""
    kept = {p.id for p in test_sm90_pipeline.CASES}
    left = [p for p in test_sm90_pipeline.pipeline() if p.id not in kept]
    assert sorted({p.tokens for p in left}) == [1, 128, 4096]
    assert all(p.hidden == 7168 for p in left) and len(left) == 6
