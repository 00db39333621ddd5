"""The bad-input catalogue (tests/cli/bad_input.py), the public Python API's part (issue 27):
moe_verify.verify and verify_rank, NaN and Inf in given inputs, the golden (run, and its layout,
gather and GEMM helpers), OptimizedBackend, and tolerance's entry points."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import pytest
import torch

import moe_verify.run.inputs as inputs_mod
import reference
import tolerance
from moe_verify.run.inputs import make_inputs
from moe_verify.spec import Mode, MoEInputs, MoEProblem, Trace
from optimized import OptimizedBackend
from optimized.routing import apply_router_weight_on_input
from reference import formats, layout
from reference import gather as gather_ref
from reference import gemm as gemm_ref
from reference.routing import router_weighted_input
from tests.cli.bad_input import TINY, Bad, bad, check_refused_clearly, params

pytestmark = pytest.mark.cpu

SMALL = dict(TINY, alignment=32)


@functools.cache
def _small_inputs() -> MoEInputs:
    return make_inputs(MoEProblem(**SMALL), "cpu")


@functools.cache
def _golden_trace() -> Trace:
    return reference.run(MoEProblem(**SMALL), _small_inputs(), 0)


def _verify(**kwargs: object) -> object:
    from moe_verify import verify

    return verify(MoEProblem(**SMALL), **kwargs)


def _spoiled(path: str, value: float, at: tuple[int, ...] = (0, 0)) -> MoEInputs:
    """The small inputs with one element of `path` ('hidden_states', 'w13_q.scale', ...) set to
    `value` (a NaN code 0x7F for fp8 weights)."""
    x = _small_inputs()
    name, _, part = path.partition(".")
    if not part:
        t = getattr(x, name).clone()
        t[at] = value
        return dataclasses.replace(x, **{name: t})
    w = getattr(x, name)
    t = getattr(w, part).clone()
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8)[at] = 0x7F  # e4m3fn's NaN code
    else:
        t[at] = value
    return dataclasses.replace(x, **{name: dataclasses.replace(w, **{part: t})})


def _file_path() -> str:
    """A path under a regular file (this test module: it always exists and is never written), so
    no directory can be made there."""
    return str(Path(__file__).resolve() / "dumps")


def _public_api_rows() -> list[Bad]:
    from moe_verify.run import verify as verification

    nan, inf = math.nan, math.inf
    p = MoEProblem(**SMALL)
    rows = [
        bad("verify-backend-int", lambda: _verify(backend=42), TypeError, "backend", "42"),
        bad(
            "verify-backend-unknown-name",
            lambda: _verify(backend="banana"),
            ValueError,
            "backend",
            "'banana'",
        ),
        bad(
            "verify-backend-missing-class",
            lambda: _verify(backend="moe_verify.examples:NoSuchKernel"),
            ValueError,
            "backend",
            "NoSuchKernel",
        ),
        bad(
            "verify-compare_device-banana",
            lambda: _verify(compare_device="banana"),
            ValueError,
            "compare_device",
            "'banana'",
        ),
        bad(
            "verify-compare_device-int",
            lambda: _verify(compare_device=3),
            TypeError,
            "compare_device",
            "3",
        ),
        # parses, but no machine has a hundredth GPU: refused before the case runs to the end
        bad(
            "verify-compare_device-absent",
            lambda: _verify(compare_device="cuda:99"),
            ValueError,
            "compare_device",
            "'cuda:99'",
            "not usable here",
        ),
        bad("verify-device-banana", lambda: _verify(device="banana"), ValueError, "device"),
        bad(
            "verify-device-absent",
            lambda: _verify(device="cuda:99"),
            ValueError,
            "device",
            "'cuda:99'",
        ),
        bad(
            "verify-dump_dir-under-a-file",
            lambda: _verify(dump_dir=_file_path()),
            ValueError,
            "dump_dir",
            "is a file",
        ),
        bad(
            "verify-plot_dir-under-a-file",
            lambda: _verify(plot_dir=_file_path()),
            ValueError,
            "plot_dir",
            "is a file",
        ),
        bad(
            "verify-problem-dict",
            lambda: verification.verify(dict(SMALL)),
            TypeError,
            "problem",
            "dict",
        ),
        bad(
            "verify_rank-rank-past-the-topology",
            lambda: verification.verify_rank(
                p,
                _small_inputs(),
                reference.ReferenceBackend(),
                reference.ReferenceBackend(),
                9,
                (Mode.ISOLATED,),
            ),  # fmt: skip
            ValueError,
            "rank",
            "9",
        ),
        bad(
            "verify_rank-modes-string",
            lambda: verification.verify_rank(
                p,
                _small_inputs(),
                reference.ReferenceBackend(),
                reference.ReferenceBackend(),
                0,
                "isolated",
            ),  # fmt: skip
            TypeError,
            "modes",
            "'isolated'",
        ),
        bad(
            "verify_rank-modes-unknown",
            lambda: verification.verify_rank(
                p,
                _small_inputs(),
                reference.ReferenceBackend(),
                reference.ReferenceBackend(),
                0,
                ("iso",),
            ),  # fmt: skip
            ValueError,
            "modes",
            "'iso'",
        ),
        # NaN and Inf in given inputs: named by tensor and count, before the golden runs
        bad(
            "verify-inputs-hidden_states-nan",
            lambda: _verify(inputs=_spoiled("hidden_states", nan)),
            ValueError,
            "inputs.hidden_states",
            "1 NaN",
        ),
        bad(
            "check_inputs-router_logits-inf",
            lambda: inputs_mod.check_inputs(p, _spoiled("router_logits", -inf)),
            ValueError,
            "inputs.router_logits",
            "1 Inf",
        ),
        bad(
            "check_inputs-w13-nan",
            lambda: inputs_mod.check_inputs(p, _spoiled("w13", nan, (0, 0, 0))),
            ValueError,
            "inputs.w13",
            "1 NaN",
        ),
        bad(
            "check_inputs-w13_q-scale-inf",
            lambda: inputs_mod.check_inputs(p, _spoiled("w13_q.scale", inf, (1, 0, 0))),
            ValueError,
            "inputs.w13_q.scale",
            "1 Inf",
        ),
        bad(
            "check_inputs-w2_q-nan-code",
            lambda: inputs_mod.check_inputs(p, _spoiled("w2_q.q", nan, (3, 5, 7))),
            ValueError,
            "inputs.w2_q.q",
            "1 NaN",
        ),
        bad(
            "make_inputs-device-absent",
            lambda: make_inputs(p, "cuda:99"),
            ValueError,
            "device",
            "'cuda:99'",
        ),
        # the golden: run, and its layout, gather and GEMM helpers
        bad("reference.run-problem-dict", lambda: reference.run({}, None), TypeError, "problem"),
        bad(
            "reference.run-inputs-none",
            lambda: reference.run(p, None),
            TypeError,
            "inputs",
            "None",
        ),
        bad(
            "reference.run-rank-string",
            lambda: reference.run(p, _small_inputs(), "0"),
            TypeError,
            "rank",
            "'0'",
        ),
        bad(
            "OptimizedBackend.run-rank-past-the-topology",
            lambda: OptimizedBackend().run(p, _small_inputs(), 1),
            ValueError,
            "rank",
            "1",
        ),
        bad(
            "OptimizedBackend-exact_m_sum-1",
            lambda: OptimizedBackend(exact_m_sum=1),
            TypeError,
            "exact_m_sum",
            "1",
        ),
    ]
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    for kind, expert_map, exc, needle in (
        ("float", torch.tensor([0.0, 1.0, -1.0, -1.0]), ValueError, "float32"),
        ("bool", torch.tensor([False, True, True, True]), ValueError, "bool"),
        ("2d", torch.tensor([[0, 1], [-1, -1]]), ValueError, "(2, 2)"),
        ("list", [0, 1, -1, -1], TypeError, "[0, 1, -1, -1]"),
        ("past-E_l", torch.tensor([0, 1, 5, -1]), ValueError, "[-1, 5]"),
    ):
        rows.append(
            bad(
                f"reference.permute_plan-expert_map-{kind}",
                lambda m=expert_map: layout.permute_plan(ids, 2, 32, m),
                exc,
                "expert_map",
                needle,
            )
        )
        if kind != "past-E_l":  # local_expert_ids knows no E_l
            rows.append(
                bad(
                    f"reference.local_expert_ids-expert_map-{kind}",
                    lambda m=expert_map: layout.local_expert_ids(ids, m),
                    exc,
                    "expert_map",
                    needle,
                )
            )
    rows += [
        bad(
            "reference.local_expert_ids-id-past-the-map",
            lambda: layout.local_expert_ids(ids, torch.tensor([0, 1, -1])),
            ValueError,
            "topk_ids",
            "max id 3",
        ),
        bad(
            "reference.permute_plan-num_local_experts-float",
            lambda: layout.permute_plan(ids, 4.0, 32),
            TypeError,
            "num_local_experts",
            "4.0",
        ),
        bad(
            "reference.expert_counts-float-ids",
            lambda: layout.expert_counts(ids.float(), 4),
            ValueError,
            "local_ids",
            "float32",
        ),
        bad(
            "reference.expert_counts-num_local_experts--1",
            lambda: layout.expert_counts(ids.long(), -1),
            ValueError,
            "num_local_experts",
            "-1",
        ),
        bad(
            "reference.m_indices_from_expert_ends-float-ends",
            lambda: layout.m_indices_from_expert_ends(torch.tensor([1.0, 2.0]), 64, 32),
            ValueError,
            "expert_ends",
            "float32",
        ),
        bad(
            "reference.m_indices_from_expert_ends-alignment-0",
            lambda: layout.m_indices_from_expert_ends(torch.tensor([1, 2]), 64, 0),
            ValueError,
            "alignment",
            "0",
        ),
        bad(
            "reference.gather-expert_map-float",
            lambda: gather_ref.gather(
                torch.zeros(64, 128, dtype=torch.bfloat16),
                ids,
                torch.ones(2, 2),
                ids,
                torch.tensor([0.0, 1.0, 2.0, 3.0]),
            ),  # fmt: skip
            ValueError,
            "expert_map",
            "float32",
        ),
        bad(
            "reference.router_weighted_input-top2",
            lambda: router_weighted_input(
                torch.zeros(4, 128, dtype=torch.bfloat16), torch.ones(4, 2)
            ),
            ValueError,
            "topk_weights",
            "[M, 1] = [4, 1]",
            "(4, 2)",
        ),
        bad(
            "optimized.apply_router_weight_on_input-top2",
            lambda: apply_router_weight_on_input(
                torch.zeros(4, 128, dtype=torch.bfloat16), torch.ones(4, 2)
            ),
            ValueError,
            "topk_weights",
            "[M, 1] = [4, 1]",
            "(4, 2)",
        ),
        bad(
            "reference.gather-topk_weights-int",
            lambda: gather_ref.gather(torch.zeros(64, 128, dtype=torch.bfloat16), ids, ids, ids),
            ValueError,
            "topk_weights",
            "int32",
        ),
    ]
    a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    for group, needle in ((0, "0"), (-128, "-128"), (96, "group=96"), (64.0, "64.0")):
        rows.append(
            bad(
                f"reference.dequantize_activations-group-{group!r}",
                lambda g=group: gemm_ref.dequantize_activations(a, torch.ones(4, 1), g),
                ValueError,
                "group",
                needle,
            )
        )
    rows.append(
        bad(
            "reference.grouped_gemm-a_group-0",
            lambda: gemm_ref.grouped_gemm(
                a, torch.ones(4, 1), 0, _small_inputs().w13_q, torch.zeros(4, dtype=torch.int32)
            ),
            ValueError,
            "a_group",
            "0",
        )
    )
    x = torch.zeros(4, 128)
    for group in (-1, 96, 64.0):
        rows.append(
            bad(
                f"reference.quantize_fp8_groups-group-{group!r}",
                lambda g=group: formats.quantize_fp8_groups(x, group=g),
                ValueError,
                "group",
                str(group),
            )
        )
    # tolerance: the comparison's entry points
    g = _golden_trace
    rows += [
        bad(
            "tolerance.compare-mode-iso",
            lambda: tolerance.compare(g(), g(), p, mode="iso"),
            ValueError,
            "mode",
            "'iso'",
        ),
        bad(
            "tolerance.compare-device-banana",
            lambda: tolerance.compare(g(), g(), p, device="banana"),
            ValueError,
            "device",
            "'banana'",
        ),
        bad(
            "tolerance.compare-golden-none",
            lambda: tolerance.compare(None, g(), p),
            TypeError,
            "golden",
            "None",
        ),
        bad(
            "tolerance.compare-problem-dict",
            lambda: tolerance.compare(g(), g(), dict(SMALL)),
            TypeError,
            "problem",
            "dict",
        ),
        bad(
            "tolerance.compare-stages-unknown",
            lambda: tolerance.compare(g(), g(), p, stages=["permutation"]),
            ValueError,
            "stage",
            "'permutation'",
        ),
        bad(
            "tolerance.compare_stage-stage-unknown",
            lambda: tolerance.compare_stage("gemm3", g(), g(), p),
            ValueError,
            "stage",
            "'gemm3'",
        ),
        bad(
            "tolerance.keyed_values-mode-both",
            lambda: tolerance.keyed_values("gemm1", g(), g(), p, mode="both"),
            ValueError,
            "mode",
            "'both'",
        ),
        bad(
            "tolerance.policy_for-problem-dict",
            lambda: tolerance.policy_for("gemm1", dict(SMALL)),
            TypeError,
            "problem",
            "dict",
        ),
        bad(
            "tolerance.policy_for-mode-iso",
            lambda: tolerance.policy_for("gemm1", p, "iso"),
            ValueError,
            "mode",
            "'iso'",
        ),
    ]
    return rows


CATALOGUE: list[Bad] = _public_api_rows()


@pytest.mark.parametrize("row", params(CATALOGUE))
def test_bad_input_is_refused_clearly(row: Bad) -> None:
    check_refused_clearly(row)
