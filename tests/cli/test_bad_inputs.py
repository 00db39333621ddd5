"""The bad-input catalogue (tests/cli/bad_input.py), the part a run is given: inputs that do
not fit their problem (check_inputs, make_inputs), the pre-flight memory estimate and the preset
names; and the catalogue's ids, unique across its files."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import moe_verify.run.inputs as inputs_mod
from moe_verify.run.inputs import make_inputs
from moe_verify.spec import MoEInputs, MoEProblem, QuantizedWeight
from moe_verify.sweep import cases
from tests.cli import test_bad_api_calls, test_bad_kernel_args, test_bad_problems
from tests.cli.bad_input import GROUPED, Bad, bad, check_refused_clearly, params, tiny

pytestmark = pytest.mark.cpu


@functools.cache
def _inputs_of(problem: MoEProblem) -> MoEInputs:
    """make_inputs once per problem (rows only read them, or replace fields of a copy)."""
    return make_inputs(problem, "cpu")


def _replace_inputs(problem: MoEProblem, **changes: object) -> MoEInputs:
    return dataclasses.replace(_inputs_of(problem), **changes)


def _check(problem: MoEProblem, x: MoEInputs) -> None:
    inputs_mod.check_inputs(problem, x)


def _check_inputs_rows() -> list[Bad]:
    p = tiny()
    uniform = tiny(routing="uniform")
    return [
        bad(
            "check_inputs-E4-inputs-for-E8",
            lambda: _check(p.replace(num_experts=8), _inputs_of(p)),
            ValueError,
            "inputs.",
            "[4, 4]",
            "E8",
        ),
        bad(
            "check_inputs-T4-inputs-for-T8",
            lambda: _check(p.replace(tokens=8), _inputs_of(p)),
            ValueError,
            "inputs.hidden_states",
            "[4, 128]",
            "T8",
        ),
        bad(
            "check_inputs-H128-inputs-for-H256",
            lambda: _check(p.replace(hidden=256), _inputs_of(p)),
            ValueError,
            "inputs.hidden_states",
            "[4, 128]",
        ),
        bad(
            "check_inputs-I128-inputs-for-I256",
            lambda: _check(p.replace(intermediate=256), _inputs_of(p)),
            ValueError,
            "inputs.w13",
            "[4, 256, 128]",
        ),
        bad(
            "check_inputs-fp8-inputs-for-mxfp8",
            lambda: _check(p.replace(recipe="mxfp8", scale_fmt="ue8m0_packed"), _inputs_of(p)),
            ValueError,
            "inputs.w13_q",
            "(128, 128)",
        ),
        bad(
            "check_inputs-shared-missing",
            lambda: _check(p.replace(shared_experts=1), _inputs_of(p)),
            ValueError,
            "inputs.shared_w13",
            "None",
        ),
        bad(
            "check_inputs-shared-unexpected",
            lambda: _check(p, _inputs_of(p.replace(shared_experts=1))),
            ValueError,
            "inputs.shared_w13",
            "QuantizedWeight",
        ),
        bad(
            "check_inputs-bias-without-grouped",
            lambda: _check(p, _replace_inputs(p, score_bias=torch.zeros(4))),
            ValueError,
            "inputs.score_bias",
            "[4]",
        ),
        bad(
            "check_inputs-bias-wrong-shape",
            lambda: _check(
                tiny(**GROUPED),
                _replace_inputs(tiny(**GROUPED), score_bias=torch.zeros(4)),
            ),
            ValueError,
            "inputs.score_bias",
            "[4]",
        ),
        bad(
            "check_inputs-ids-missing-for-uniform",
            lambda: _check(uniform, _replace_inputs(uniform, topk_ids=None, topk_weights=None)),
            ValueError,
            "inputs.topk_ids",
            "None",
        ),
        bad(
            "check_inputs-ids-without-weights",
            lambda: _check(uniform, _replace_inputs(uniform, topk_weights=None)),
            ValueError,
            "topk_weights",
            "None",
        ),
        bad(
            "check_inputs-ids-out-of-range",
            lambda: _check(
                uniform,
                _replace_inputs(uniform, topk_ids=torch.full((4, 2), 9, dtype=torch.int32)),
            ),
            ValueError,
            "inputs.topk_ids",
            "9",
        ),
        bad(
            "check_inputs-ids-float",
            lambda: _check(uniform, _replace_inputs(uniform, topk_ids=torch.zeros(4, 2))),
            ValueError,
            "inputs.topk_ids",
            "torch.float32",
        ),
        bad(
            "check_inputs-hidden-fp32",
            lambda: _check(p, _replace_inputs(p, hidden_states=torch.zeros(4, 128))),
            ValueError,
            "inputs.hidden_states",
            "torch.float32",
        ),
        bad(
            "check_inputs-logits-other-device",
            lambda: _check(p, _replace_inputs(p, router_logits=torch.zeros(4, 4, device="meta"))),
            ValueError,
            "inputs.router_logits",
            "meta",
        ),
        bad(
            "check_inputs-weight-not-quantized",
            lambda: _check(p, _replace_inputs(p, w2_q=torch.zeros(4, 128, 128))),
            ValueError,
            "inputs.w2_q",
            "a tensor",
        ),
        bad(
            "check_inputs-ckpt-without-requant",
            lambda: _check(p, _replace_inputs(p, w13_ckpt=_inputs_of(p).w13_q)),
            ValueError,
            "inputs.w13_ckpt",
            "QuantizedWeight",
        ),
        bad(
            "check_inputs-scale-wrong-shape",
            lambda: _check(
                p,
                _replace_inputs(
                    p,
                    w2_q=QuantizedWeight(_inputs_of(p).w2_q.q, torch.ones(4, 2, 2), (128, 128)),
                ),
            ),
            ValueError,
            "inputs.w2_q.scale",
            "[4, 2, 2]",
        ),
        bad(
            "check_inputs-not-inputs",
            lambda: _check(p, {"hidden_states": None}),
            TypeError,
            "inputs",
            "dict",
        ),
        bad(
            "check_inputs-not-problem",
            lambda: _check("fp8_block", _inputs_of(p)),
            TypeError,
            "problem",
            "str",
        ),
        bad("make_inputs-not-problem", lambda: make_inputs("tiny", "cpu"), TypeError, "str"),
        bad("make_inputs-device-gpu", lambda: make_inputs(p, "gpu"), ValueError, "'gpu'"),
        bad("make_inputs-device-int", lambda: make_inputs(p, 1.5), TypeError, "1.5"),
    ]


def _preflight(problem: object, device: object) -> None:
    from moe_verify.run.preflight import preflight

    preflight(problem, device)


# Far beyond any machine's memory, yet within MoEProblem's bounds (DeepSeek-V3's layer shape).
HUGE = MoEProblem(tokens=1_000_000, hidden=7168, intermediate=2048, num_experts=256, topk=8)


def _preflight_and_preset_rows() -> list[Bad]:
    return [
        bad(
            "preflight-huge-problem-cpu",
            lambda: _preflight(HUGE, "cpu"),
            ValueError,
            "T1000000",
            "largest tensor",
            "GiB",
            "free",
        ),
        bad("preflight-not-problem", lambda: _preflight({"tokens": 4}, "cpu"), TypeError, "dict"),
        bad("preflight-device-int", lambda: _preflight(tiny(), 3.5), TypeError, "3.5"),
        bad("preset-unknown", lambda: cases.preset("smoke2"), ValueError, "preset", "'smoke2'"),
        bad("preset-case", lambda: cases.preset("SMOKE"), ValueError, "preset", "'SMOKE'"),
        bad("preset-empty", lambda: cases.preset(""), ValueError, "preset", "''"),
        bad("preset-none", lambda: cases.preset(None), ValueError, "preset", "None"),
        bad("preset-list", lambda: cases.preset(["smoke"]), ValueError, "preset", "['smoke']"),
    ]


CATALOGUE: list[Bad] = [*_check_inputs_rows(), *_preflight_and_preset_rows()]


@pytest.mark.parametrize("row", params(CATALOGUE))
def test_bad_input_is_refused_clearly(row: Bad) -> None:
    check_refused_clearly(row)


def test_catalogue_ids_are_unique() -> None:
    ids = [
        r.id
        for module in (test_bad_problems, test_bad_kernel_args, test_bad_api_calls)
        for r in module.CATALOGUE
    ] + [r.id for r in CATALOGUE]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


# Every curated case, shrunk where it is large, so make_inputs stays in milliseconds: the rows
# (routing, topology, recipe, shared experts) are what check_inputs reads.
def _small(p: MoEProblem) -> MoEProblem:
    if p.tokens * p.hidden * p.intermediate * p.num_experts <= 1 << 24:
        return p
    return p.replace(tokens=min(p.tokens, 16), num_experts=min(p.num_experts, 16))


CURATED = [
    pytest.param(_small(p), id=f"{name}-{p.id}")
    for name in ("smoke", "topology")
    for p in cases.preset(name)
]


@pytest.mark.parametrize("problem", CURATED)
def test_make_inputs_outputs_pass_check_inputs(problem: MoEProblem) -> None:
    inputs_mod.check_inputs(problem, make_inputs(problem, "cpu"))


def test_small_default_problem_passes_preflight() -> None:
    _preflight(MoEProblem(), "cpu")
    _preflight(tiny(), "meta")  # memory unknown: not checked


def test_preflight_names_the_largest_tensor() -> None:
    from moe_verify.run.preflight import estimate

    est = estimate(HUGE)
    big = est.largest
    assert big.bytes_each == max(i.bytes_each for i in est.items)
    with pytest.raises(ValueError) as info:
        _preflight(HUGE, "cpu")
    assert big.name in str(info.value) and str(list(big.shape)) in str(info.value)
