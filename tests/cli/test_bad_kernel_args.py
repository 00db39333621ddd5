"""The bad-input catalogue (tests/cli/bad_input.py), the kernels' part: the M_sum bounds of
both sides, the Triton kernel wrappers, the golden's quantizers and the DeepGEMM calls."""

from __future__ import annotations

import math

import pytest
import torch

from moe_verify.spec import Activation, QuantizedWeight
from optimized import deepgemm
from optimized.kernels import act_quant, gather, grouped_gemm, quant, scatter, slot_counts
from reference import formats, layout
from tests.cli.bad_input import Bad, bad, check_refused_clearly, params

pytestmark = pytest.mark.cpu


def _m_sum_rows() -> list[Bad]:
    rows = []
    counts = torch.tensor([1, 2], dtype=torch.int32)
    for mod, name in ((layout, "reference"), (slot_counts, "optimized")):
        bounds = (
            ("upper_bound", mod.aligned_m_sum_upper_bound),
            ("all_experts_bound", getattr(mod, "aligned_m_sum_all_experts_bound", None)),
        )
        for fn_name, fn in bounds:
            if fn is None:
                continue
            for arg, index, value, exc in (
                ("num_tokens", 0, -1, ValueError),
                ("topk", 1, -2, ValueError),
                ("num_local_experts", 2, -4, ValueError),
                ("alignment", 3, 0, ValueError),
                ("alignment", 3, -128, ValueError),
                ("num_tokens", 0, 4.5, TypeError),
                ("topk", 1, True, TypeError),
                ("alignment", 3, None, TypeError),
            ):
                args = [4, 2, 4, 128]
                args[index] = value
                rows.append(
                    bad(
                        f"{name}.aligned_m_sum_{fn_name}-{arg}-{value!r}",
                        lambda f=fn, a=tuple(args): f(*a),
                        exc,
                        arg,
                        repr(value),
                    )
                )
        for label, c, a, exc, needles in (
            ("counts-negative", torch.tensor([3, -5]), 128, ValueError, ("counts", "-5")),
            ("counts-float", torch.tensor([1.5, 2.0]), 128, ValueError, ("counts", "float")),
            ("alignment-0", counts, 0, ValueError, ("alignment", "0")),
            ("alignment-float", counts, 128.0, TypeError, ("alignment", "128.0")),
        ):
            rows.append(
                bad(
                    f"{name}.aligned_m_sum_exact-{label}",
                    lambda m=mod, c=c, a=a: m.aligned_m_sum_exact(c, a),
                    exc,
                    *needles,
                )
            )
    rows += [
        bad(
            "reference.aligned_m_sum_exact-counts-list",
            lambda: layout.aligned_m_sum_exact([1, 2], 128),
            TypeError,
            "counts",
            "list",
        ),
        bad(
            "reference.aligned_m_sum_exact-counts-2d",
            lambda: layout.aligned_m_sum_exact(torch.ones(2, 2, dtype=torch.int32), 128),
            ValueError,
            "counts",
            "[2, 2]",
        ),
        bad(
            "reference.aligned_m_sum_recipes-counts-negative",
            lambda: layout.aligned_m_sum_recipes(4, 2, torch.tensor([-1, 9]), 128),
            ValueError,
            "counts",
            "-1",
        ),
        bad(
            "optimized.aligned_m_sum_exact-counts-bool",
            lambda: slot_counts.aligned_m_sum_exact([True, 2], 128),
            TypeError,
            "counts[0]",
            "True",
        ),
    ]
    return rows


def _kernel_rows() -> list[Bad]:
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    rows = []
    for fn_name, fn in (
        ("quantize_fp8_groups", quant.quantize_fp8_groups),
        ("quantize_fp8_groups_packed", quant.quantize_fp8_groups_packed),
    ):
        for value in (0.0, -1e-10, math.nan, math.inf):
            rows.append(
                bad(
                    f"kernels.{fn_name}-eps-{value}",
                    lambda f=fn, v=value: f(x, eps=v),
                    ValueError,
                    "eps",
                    repr(value),
                )
            )
        for value in (True, "1e-10", None):
            rows.append(
                bad(
                    f"kernels.{fn_name}-eps-{type(value).__name__}",
                    lambda f=fn, v=value: f(x, eps=v),
                    TypeError,
                    "eps",
                    repr(value),
                )
            )
    for arg, value, exc in (
        ("scale_fmt", "fp32", ValueError),
        ("scale_fmt", 3, TypeError),
        ("column_major", "no", TypeError),
        ("column_major", 1, TypeError),
        ("tma_aligned", "yes", TypeError),
    ):
        rows.append(
            bad(
                f"kernels.quantize_fp8_groups-{arg}-{value!r}",
                lambda a=arg, v=value: quant.quantize_fp8_groups(x, **{a: v}),
                exc,
                arg,
                repr(value),
            )
        )
    rows.append(
        bad(
            "kernels.quantize_fp8_groups-group-bool",
            lambda: quant.quantize_fp8_groups(x, group=True),
            ValueError,
            "group",
            "True",
        )
    )
    rows.append(
        bad(
            "kernels.pack_ue8m0_from_fp32-validate-no",
            lambda: quant.pack_ue8m0_from_fp32(torch.ones(4, 4), validate="no"),
            TypeError,
            "validate",
            "'no'",
        )
    )
    mm1 = torch.zeros(4, 256, dtype=torch.bfloat16)
    silu = Activation()
    for arg, value, exc in (
        ("scale_fmt", "packed", ValueError),
        ("scale_fmt", None, TypeError),
        ("validate", "no", TypeError),
        ("validate", 0, TypeError),
    ):
        rows.append(
            bad(
                f"kernels.silu_mul_quant-{arg}-{value!r}",
                lambda a=arg, v=value: act_quant.silu_mul_quant(
                    mm1, silu, 128, **{"scale_fmt": "float32", a: v}
                ),
                exc,
                arg,
                repr(value),
            )
        )
    rows.append(
        bad(
            "kernels.silu_mul_quant-activation-string",
            lambda: act_quant.silu_mul_quant(mm1, "silu", 128, "float32"),
            ValueError,
            "activation",
            "str",
        )
    )
    dummy = torch.zeros(1)
    for arg, value in (("use_psum_layout", "no"), ("validate", 1)):
        rows.append(
            bad(
                f"kernels.grouped_gemm-{arg}-{value!r}",
                lambda a=arg, v=value: grouped_gemm.grouped_gemm(
                    dummy, dummy, 128, dummy, dummy, (128, 128), dummy, 128, **{a: v}
                ),
                TypeError,
                arg,
                repr(value),
            )
        )
    rows += [
        bad(
            "kernels.ep_gather-validate-no",
            lambda: gather.ep_gather(dummy, dummy, dummy, dummy, validate="no"),
            TypeError,
            "validate",
            "'no'",
        ),
        bad(
            "kernels.count_expert_tokens-validate-no",
            lambda: slot_counts.count_expert_tokens(dummy, 4, validate="no"),
            TypeError,
            "validate",
            "'no'",
        ),
        bad(
            "kernels.ep_scatter-validate-none",
            lambda: scatter.ep_scatter(dummy, dummy, dummy, dummy, 4, 128, 128, validate=None),
            TypeError,
            "validate",
            "None",
        ),
    ]
    return rows


def _reference_quant_rows() -> list[Bad]:
    w = torch.zeros(128, 128)
    rows = [
        bad(
            f"reference.quantize_fp8_blocks-use_ue8m0-{value!r}",
            lambda v=value: formats.quantize_fp8_blocks(w, (128, 128), use_ue8m0=v),
            TypeError,
            "use_ue8m0",
            repr(value),
        )
        for value in ("no", 1, None, "False")
    ]
    rows += [
        bad(
            f"reference.quantize_fp8_groups-eps-{value!r}",
            lambda v=value: formats.quantize_fp8_groups(w, eps=v),
            ValueError,
            "eps",
            repr(value),
        )
        for value in (True, 0.0, -1.0, math.nan, math.inf)
    ]
    rows += [
        bad(
            "reference.quantize_fp8_groups-group-0",
            lambda: formats.quantize_fp8_groups(w, group=0),
            ValueError,
            "group",
            "0",
        ),
        bad(
            "reference.quantize_fp8_groups-scale_fmt",
            lambda: formats.quantize_fp8_groups(w, scale_fmt="fp32"),
            ValueError,
            "scale_fmt",
            "'fp32'",
        ),
    ]
    return rows


def _deepgemm_rows() -> list[Bad]:
    a = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    w = QuantizedWeight(
        torch.zeros(1, 128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, 1), (128, 128)
    )
    layout_ = torch.zeros(128, dtype=torch.int32)
    scale = torch.ones(128, 1)
    rows = []
    for value in ("no", 1, None):
        rows += [
            bad(
                f"deepgemm.validate_contiguous_call-use_ue8m0-{value!r}",
                lambda v=value: deepgemm.validate_contiguous_call(a, scale, w, layout_, 128, v),
                TypeError,
                "use_ue8m0",
                repr(value),
            ),
            bad(
                f"deepgemm.m_grouped_gemm-use_ue8m0-{value!r}",
                lambda v=value: deepgemm.m_grouped_gemm(
                    a, scale, 128, w, scale, layout_, 128, use_ue8m0=v
                ),
                TypeError,
                "use_ue8m0",
                repr(value),
            ),
            bad(
                f"deepgemm.m_grouped_gemm_masked-use_ue8m0-{value!r}",
                lambda v=value: deepgemm.m_grouped_gemm_masked(
                    a, scale, w, scale, layout_, 128, use_ue8m0=v
                ),
                TypeError,
                "use_ue8m0",
                repr(value),
            ),
            bad(
                f"deepgemm.prepare_weight_scales-use_ue8m0-{value!r}",
                lambda v=value: deepgemm.prepare_weight_scales(w, v),
                TypeError,
                "use_ue8m0",
                repr(value),
            ),
        ]
    rows.append(
        bad(
            "deepgemm.m_grouped_gemm-use_psum_layout-yes",
            lambda: deepgemm.m_grouped_gemm(
                a, scale, 128, w, scale, layout_, 128, use_ue8m0=False, use_psum_layout="yes"
            ),
            TypeError,
            "use_psum_layout",
            "'yes'",
        )
    )
    return rows


CATALOGUE: list[Bad] = [
    *_m_sum_rows(),
    *_kernel_rows(),
    *_reference_quant_rows(),
    *_deepgemm_rows(),
]


@pytest.mark.parametrize("row", params(CATALOGUE))
def test_bad_input_is_refused_clearly(row: Bad) -> None:
    check_refused_clearly(row)
