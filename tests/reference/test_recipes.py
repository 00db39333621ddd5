"""The golden's legitimate recipes: vLLM's two input quantizers and its three act_quant kernels,
each against a direct computation written here (numpy float32 for the quantizers, torch bf16
arithmetic for the low-latency kernel), plus where the recipes differ and where each applies.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.spec import (
    Activation,
    ActQuantRecipe,
    InputQuantRecipe,
    MoEProblem,
    Recipe,
    ScaleFmt,
    Stage,
)
from reference.activation import act_quant, quantize_groups_bf16_steps, swiglu
from reference.formats import (
    ceil_pow2_via_log2,
    ceil_ue8m0,
    group_scales_by_division,
    group_scales_by_reciprocal,
    quantize_fp8_groups,
    ue8m0_bytes,
    unpack_ue8m0,
)
from reference.moe import ReferenceBackend
from reference.recipes import act_quant_recipes, input_quant_recipes

pytestmark = pytest.mark.cpu

CUDA, TRITON = InputQuantRecipe.CUDA_DIVISION, InputQuantRecipe.TRITON_RECIPROCAL
LMDEPLOY = InputQuantRecipe.AMAX_RECIPROCAL
LMDEPLOY_SM90 = InputQuantRecipe.AMAX_RECIPROCAL_SM90_TRITON
SGLANG_SM90 = InputQuantRecipe.FAST_RECIPROCAL_SM90_CUDA
SGLANG_ACT = "packed_fast_reciprocal_sm90_cuda"
LMDEPLOY_ACT_SM90 = "colmajor_amax_reciprocal_sm90_triton"
FLOAT32, CEIL, PACKED = ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED
SILU = Activation()
BF16 = torch.bfloat16
CEIL_PACKED = ActQuantRecipe.COLMAJOR_CEIL_PACKED


def every_bf16() -> torch.Tensor:
    """fp32 [32639]: every positive finite bf16 number (subnormals included), ascending."""
    return torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(BF16).float()


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype.itemsize == 1 else x.view(torch.int32)


def bf16_inputs(seed: int, rows: int = 64, cols: int = 512) -> torch.Tensor:
    """N(0, 1) bf16 with one all-zero group and one tiny group (amax 1e-9: below 448 * 2^-34)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[0, :128] = 0.0
    x[1, 128:256] *= 1e-9
    return x.to(BF16)


# -- vLLM's two input quantizers, against numpy float32 ---------------------------------------


def numpy_quant(x: torch.Tensor, fmt: ScaleFmt, recipe: InputQuantRecipe) -> tuple:
    """Direct per-element computation of each kernel's arithmetic (fp8_utils.py and
    per_token_group_quant.cu, vLLM 0.32): returns (fp32 x / s before the e4m3 cast, s)."""
    xg = x.float().numpy().reshape(x.shape[0], -1, 128)
    amax = np.maximum(np.abs(xg).max(axis=-1), np.float32(1e-10))
    if recipe is CUDA:
        s = amax / np.float32(448.0)
        if fmt.is_ue8m0:  # floor on the scale, then exponent + (mantissa != 0)
            s = np.maximum(s, np.float32(1e-10))
            m, e = np.frexp(s)  # s = m * 2^e, m in [0.5, 1)
            s = np.ldexp(np.float32(1.0), np.where(m == 0.5, e - 1, e)).astype(np.float32)
    else:
        s = amax * np.float32(1.0 / 448.0)
        if fmt.is_ue8m0:  # the interpreter's tl.log2 / tl.ceil / tl.exp2: numpy float32
            s = np.exp2(np.ceil(np.log2(s))).astype(np.float32)
    return torch.from_numpy(xg / s[..., None]), torch.from_numpy(s)


@pytest.mark.parametrize("recipe", [CUDA, TRITON])
@pytest.mark.parametrize("fmt", [FLOAT32, CEIL, PACKED])
def test_input_quant_recipe_matches_direct_computation(
    recipe: InputQuantRecipe, fmt: ScaleFmt
) -> None:
    x = bf16_inputs(seed=1)
    q, s = quantize_fp8_groups(x, 128, fmt, recipe=recipe)
    scaled, s_ref = numpy_quant(x, fmt, recipe)
    assert torch.equal(bits(s), bits(s_ref))
    q_ref = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).reshape(x.shape)
    assert torch.equal(bits(q), bits(q_ref))


def test_zero_group_scales_differ_between_recipes() -> None:
    # cuda: max(1e-10 / 448, 1e-10) = 1e-10 -> 2^-33 (byte 94); triton: 1e-10 * (1/448) =
    # 2.2e-13, log2 = -42.03 -> 2^-42 (byte 85). Both quantize the zeros to code 0.
    x = torch.zeros(1, 128, dtype=BF16)
    for recipe, byte in ((CUDA, 94), (TRITON, 85)):
        q, s = quantize_fp8_groups(x, 128, CEIL, recipe=recipe)
        assert ue8m0_bytes(s).tolist() == [[byte]]
        assert int(bits(q).abs().sum()) == 0


def test_ue8m0_recipes_differ_only_below_448_times_2_pow_minus_34() -> None:
    # Every bf16 amax: the scale floor sits on the scale (cuda) or on amax (triton), so they
    # differ exactly where amax * (1/448) <= 2^-34, i.e. amax <= 448 * 2^-34 = 2.6e-8.
    amax = every_bf16().clamp(min=1e-10)
    amax = amax[amax * (1 / 448) <= 2.0**127]
    cuda = group_scales_by_division(amax, CEIL)
    triton = group_scales_by_reciprocal(amax, CEIL)
    assert torch.equal(cuda != triton, amax <= 448 * 2.0**-34)


def test_fp32_recipes_differ_by_at_most_one_ulp_in_scale() -> None:
    amax = every_bf16()
    amax = amax[amax * (1 / 448) <= 2.0**127].clamp(min=1e-10)
    cuda = group_scales_by_division(amax, FLOAT32)
    triton = group_scales_by_reciprocal(amax, FLOAT32)
    ulps = (bits(cuda).long() - bits(triton).long()).abs()
    assert int(ulps.max()) == 1
    assert 0.5 < float((ulps == 1).float().mean()) < 0.9  # most bf16 amax: "many groups"


@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_recipes_codes_differ_by_one_step_where_scales_differ(seed: int) -> None:
    x = bf16_inputs(seed, rows=256, cols=1024)
    (qc, sc), (qt, st) = (quantize_fp8_groups(x, 128, FLOAT32, recipe=r) for r in (CUDA, TRITON))
    moved = bits(qc) != bits(qt)
    assert 0 < int(moved.sum()) < x.numel() // 100  # at ties only: rare, but there
    same_scale = (bits(sc) == bits(st)).repeat_interleave(128, dim=1)
    assert not bool((moved & same_scale).any())
    steps = (bits(qc).to(torch.int16) - bits(qt).to(torch.int16)).abs()  # same sign: code - code
    assert int(steps[moved].max()) == 1


def test_ceil_pow2_via_log2_is_ceil_ue8m0_on_every_bf16_amax() -> None:
    # amax * fp32(1/448) for bf16 amax is a power of two exactly or far from one, so the fp32
    # log2 of the Triton kernels never rounds the ceiling down.
    s = every_bf16().clamp(min=1e-10) * (1 / 448)
    s = s[s <= 2.0**127]
    assert torch.equal(bits(ceil_pow2_via_log2(s)), bits(ceil_ue8m0(s)))


@pytest.mark.parametrize(
    ("k", "window"), [(-40, True), (-10, True), (-2, False), (3, False), (100, True)]
)
def test_ceil_pow2_via_log2_near_a_power_of_two(k: int, window: bool) -> None:
    # log2(2^k (1 + j 2^-23)) = k + j * 1.7e-7 rounds to fp32 k for small j once the fp32 half
    # ulp at k exceeds 1.7e-7 (|k| >= 4): the Triton kernel's 2^ceil(log2 s) is then 2^k < s,
    # where the exact ceiling is 2^(k+1).
    s = torch.tensor([2.0**k * (1 + j * 2.0**-23) for j in range(0, 40)], dtype=torch.float32)
    expected = [
        2.0 ** math.ceil(float(np.float32(math.log2(float(v))))) for v in s.tolist()
    ]  # the correctly rounded fp32 log2, from Python's float64 log2
    assert ceil_pow2_via_log2(s).tolist() == expected
    assert ceil_ue8m0(s)[1].item() == 2.0 ** (k + 1)
    assert (expected[1] == 2.0**k) == window  # rounded down: the window exists


def test_quantize_fp8_groups_rejects_unknown_recipe() -> None:
    with pytest.raises(ValueError, match="recipe must be one of"):
        quantize_fp8_groups(torch.zeros(1, 128), 128, FLOAT32, recipe="torch_fallback")


# -- the low-latency CUDA kernel: every step in bf16 -------------------------------------------


def torch_bf16_steps(mm1: torch.Tensor, fmt: ScaleFmt) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16_steps kernel (as vLLM's tests/kernels/moe/test_silu_mul_fp8_quant_deep_gemm.py
    describes it) op for op in torch bf16 arithmetic (each op computes in fp32 and rounds to bf16):
    silu in fp32 then bf16, the product, amax, the scale, hlog2/hceil/hexp2, the reciprocal and y *
    (1/s); then e4m3 of the bf16 value. Returns (q, fp32 scales)."""
    i = mm1.shape[-1] // 2
    g, u = mm1[:, :i].float(), mm1[:, i:]
    y = (g / (1 + torch.exp(-g))).to(BF16) * u
    yg = y.reshape(y.shape[0], -1, 128)
    amax = torch.maximum(yg.abs().amax(-1), torch.tensor(1e-10).to(BF16))
    s = amax * (torch.tensor(1.0, dtype=BF16) / torch.tensor(448.0, dtype=BF16))
    if fmt.is_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    inv = torch.tensor(1.0, dtype=BF16) / s
    q = (yg * inv[..., None]).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    return q.reshape(y.shape), s.float()


def mm1_inputs(seed: int, rows: int = 96, cols: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mm1 = torch.randn(rows, cols, generator=g) * 2
    mm1[0, :] = 0.0  # a zero row: every group at the eps floor
    mm1[1, :] *= 1e-3
    return mm1.to(BF16)


@pytest.mark.parametrize("fmt", [FLOAT32, CEIL, PACKED])
def test_bf16_steps_matches_direct_bf16_computation(fmt: ScaleFmt) -> None:
    mm1 = mm1_inputs(seed=2)
    q, s = act_quant(mm1, SILU, 128, fmt, ActQuantRecipe.BF16_STEPS)
    q_ref, s_ref = torch_bf16_steps(mm1, fmt)
    assert torch.equal(bits(q), bits(q_ref))
    if fmt is PACKED:  # pad bytes 0: the kernel zero-fills its scales
        assert torch.equal(unpack_ue8m0(s, 2), ue8m0_bytes(s_ref))
    else:
        assert torch.equal(bits(s), bits(s_ref))


def test_bf16_steps_ceil_can_clip_the_group_max() -> None:
    # amax = bf16(0.44178) = 0.44140625; s = bf16(0.44140625 * bf16(1/448) = 0.002227783203125)
    # = 2^-10 (1 + 1/128); bf16(log2 s) = bf16(-9.98877) = -10, so s = 2^-10 and the max element
    # 0.44140625 * 1024 = 452 clips to 448. colmajor: fp32 s = 0.44140625 / 448 -> 2^-9, 226 -> 224.
    y = torch.zeros(1, 128)
    y[0, 0] = 0.44140625
    q, s = quantize_groups_bf16_steps(y, 128, CEIL)
    assert s.tolist() == [[2.0**-10]] and q.float()[0, 0].item() == 448.0
    mm1 = torch.zeros(1, 256, dtype=BF16)
    assert act_quant(mm1, SILU, 128, CEIL, ActQuantRecipe.COLMAJOR)[1].item() == 2.0**-42


def test_bf16_steps_fp32_scale_is_bf16_of_amax_times_bf16_inverse() -> None:
    # amax = 448: s = bf16(448 * 0.002227783203125 = 0.998046875), a bf16 tie -> 1.0 (even).
    y = torch.zeros(1, 128)
    y[0, 3] = -448.0
    q, s = quantize_groups_bf16_steps(y, 128, FLOAT32)
    assert s.tolist() == [[1.0]] and q.float()[0, 3].item() == -448.0


def test_bf16_steps_roundings_are_decided_with_margin_for_every_bf16_scale() -> None:
    # The kernel's hlog2 and 1/s run through approximate fp32 instructions (lg2.approx, absolute
    # error about 2^-22; rcp) before the bf16 rounding; the golden takes exact ones. Every
    # positive normal bf16 s is far enough from a bf16 rounding boundary (log2: >= 2^-20, the
    # closest being s = 0.75 at 1.6e-6; 1/s: >= 2^-13 of a bf16 step) that they round alike.
    s = every_bf16()
    s = s[(s >= 2.0**-126) & (s <= 2.0**126)].double()
    log2 = torch.log2(s)
    ulp = torch.exp2(torch.floor(torch.log2(log2.abs().clamp(min=2.0**-126))) - 7)  # bf16 step
    frac = (log2 / ulp - 0.5) % 1.0  # distance to the rounding boundary, in bf16 steps
    exact = log2 == torch.round(log2)  # powers of two: log2 is an integer, exact in any log2
    assert bool(((torch.minimum(frac, 1 - frac) * ulp > 2.0**-20) | exact).all())
    inv = 1.0 / s
    step = torch.exp2(torch.floor(torch.log2(inv)) - 7)
    frac = (inv / step - 0.5) % 1.0
    assert bool(((torch.minimum(frac, 1 - frac) > 2.0**-13) | (inv / step % 1 == 0)).all())


def test_bf16_steps_equals_colmajor_activation_for_plain_silu() -> None:
    # act = bf16(silu(g)), y = bf16(act * u): colmajor's roundings with alpha 1, beta 0, no clamp.
    mm1 = mm1_inputs(seed=3)
    i = mm1.shape[1] // 2
    direct = (mm1[:, :i].float() / (1 + torch.exp(-mm1[:, :i].float()))).to(BF16) * mm1[:, i:]
    assert torch.equal(swiglu(mm1, SILU, "colmajor"), direct.float())


@pytest.mark.parametrize(
    ("recipe", "fmt", "activation", "group", "match"),
    [
        (ActQuantRecipe.PACKED, FLOAT32, SILU, 128, "packed UE8M0 scales"),
        (ActQuantRecipe.COLMAJOR, PACKED, SILU, 128, "fp32 scales"),
        (ActQuantRecipe.BF16_STEPS, FLOAT32, Activation(limit=7.0), 128, "plain silu"),
        (ActQuantRecipe.BF16_STEPS, FLOAT32, Activation("swigluoai"), 128, "plain silu"),
        (ActQuantRecipe.BF16_STEPS, FLOAT32, SILU, 64, "128-column groups"),
        # TensorRT-LLM's kernel: packed UE8M0 bytes of 128-column groups, plain silu only
        (CEIL_PACKED, FLOAT32, SILU, 128, "scale_fmt must be ue8m0_packed, got float32"),
        (CEIL_PACKED, CEIL, SILU, 128, "scale_fmt must be ue8m0_packed, got float32_ceil"),
        (CEIL_PACKED, PACKED, Activation(limit=7.0), 128, "activation must be silu with no"),
        (CEIL_PACKED, PACKED, Activation("swigluoai"), 128, "activation must be silu with no"),
        (CEIL_PACKED, PACKED, SILU, 32, "group must be 128, got 32"),
    ],
)
def test_act_quant_rejects_a_recipe_that_cannot_run(
    recipe: ActQuantRecipe, fmt: ScaleFmt, activation: Activation, group: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        act_quant(torch.zeros(2, 256, dtype=BF16), activation, group, fmt, recipe)


# -- which recipes apply, and how the golden's trace carries them --------------------------------

P = MoEProblem(tokens=8, hidden=256, intermediate=256, num_experts=4, topk=2, alignment=32)


# What float32 scales offer: vLLM's two quantizers, LMDeploy's and its H200 twin, SGLang's H200 one;
# act_quant's colmajor family, LMDeploy's pair and SGLang's (last: it needs float32 and silu).
QUANT_FP32 = (CUDA, TRITON, LMDEPLOY, LMDEPLOY_SM90, SGLANG_SM90)
COLMAJOR_FP32 = (
    "colmajor",
    "colmajor_sm90_triton",
    "colmajor_amax_reciprocal",
    LMDEPLOY_ACT_SM90,
    SGLANG_ACT,
)


@pytest.mark.parametrize(
    ("problem", "quant", "act"),
    [
        # every Triton kernel also has its twin with the H200 gate table (alpha 1 is tabulated);
        # with float32 scales SGLang's H200 quantizer and act_quant (silu) apply too
        pytest.param(
            P,
            QUANT_FP32,
            COLMAJOR_FP32,
            id="fp8_block-float32",
        ),
        # ceil-UE8M0 fp32 scales: LMDeploy's two, not SGLang's (its UE8M0 flavour is not modelled)
        pytest.param(
            P.replace(scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0),
            (CUDA, TRITON, LMDEPLOY, LMDEPLOY_SM90),
            COLMAJOR_FP32[:-1],
            id="fp8_block-ceil",
        ),
        # SGLang clamps at bf16(limit): modelled where the limit is a bf16 value only
        pytest.param(
            P.replace(activation="silu:L7.01"),
            QUANT_FP32,
            COLMAJOR_FP32[:-1],
            id="silu-off-grid-limit",
        ),
        # packed UE8M0 with plain silu: TensorRT-LLM's kernel too ...
        pytest.param(
            P.replace(scale_fmt=PACKED),
            (CUDA, TRITON),
            ("packed", "packed_sm90_triton", "colmajor_ceil_packed"),
            id="packed",
        ),
        pytest.param(
            P.replace(recipe=Recipe.MXFP4_W4A8, scale_fmt=PACKED),
            (CUDA, TRITON),
            ("packed", "packed_sm90_triton", "colmajor_ceil_packed"),
            id="mxfp4-packed",
        ),
        # ... which takes no clamp, no swigluoai and no 32-column groups
        pytest.param(
            P.replace(scale_fmt=PACKED, activation="silu:L7"),
            (CUDA, TRITON),
            ("packed", "packed_sm90_triton"),
            id="packed-clamped",
        ),
        pytest.param(
            P.replace(scale_fmt=PACKED, activation="swigluoai"),
            (CUDA, TRITON),
            ("packed", "packed_sm90_triton"),
            id="packed-swigluoai",
        ),
        pytest.param(
            P.replace(recipe=Recipe.MXFP8, scale_fmt=PACKED),
            (),
            ("packed", "packed_sm90_triton"),
            id="mxfp8",
        ),
        # the batched low-latency layout adds vLLM's CUDA kernel for plain silu ...
        pytest.param(
            P.replace(topology="ep:2+ll"),
            QUANT_FP32,
            (*COLMAJOR_FP32, "bf16_steps"),
            id="ll",
        ),
        # ... which takes no clamp and no swigluoai
        pytest.param(
            P.replace(topology="ep:2+ll", activation="silu:L7"),
            QUANT_FP32,
            COLMAJOR_FP32,
            id="ll-clamped",
        ),
    ],
)
def test_recipes_that_apply(problem: MoEProblem, quant: tuple, act: tuple) -> None:
    assert input_quant_recipes(problem) == quant
    assert act_quant_recipes(problem) == act


def test_golden_trace_carries_every_recipe() -> None:
    p = P.replace(topology="ep:2+ll")
    trace = ReferenceBackend().run(p, make_inputs(p), rank=0)
    quant = trace[Stage.QUANT_INPUT]
    assert quant["recipe"] == "cuda_division"
    assert quant["recipe_outputs"] == {
        "cuda_division": {"a1q": "a1q", "a1q_scale": "a1q_scale"},
        "triton_reciprocal": {
            "a1q": "a1q@triton_reciprocal",
            "a1q_scale": "a1q_scale@triton_reciprocal",
        },
        **{
            r: {"a1q": f"a1q@{r}", "a1q_scale": f"a1q_scale@{r}"}
            for r in (
                "amax_reciprocal",
                "amax_reciprocal_sm90_triton",
                "fast_reciprocal_sm90_cuda",
            )
        },
    }
    hidden = make_inputs(p).hidden_states
    q, s = quantize_fp8_groups(hidden, 128, FLOAT32, recipe=TRITON)
    assert torch.equal(bits(quant["a1q@triton_reciprocal"]), bits(q))
    act = trace[Stage.ACT_QUANT]
    assert act["recipe"] == "colmajor"
    assert list(act["recipe_outputs"]) == [*COLMAJOR_FP32, "bf16_steps"]
    mm1 = trace[Stage.GEMM1]["mm1"]
    q2, s2 = act_quant(mm1.reshape(-1, mm1.shape[-1]), SILU, 128, FLOAT32, "bf16_steps")
    assert act["a2q@bf16_steps"].shape == act["a2q"].shape == (*mm1.shape[:2], 256)
    assert torch.equal(bits(act["a2q@bf16_steps"].reshape(q2.shape)), bits(q2))
    assert torch.equal(act["a2q_scale@bf16_steps"].reshape(s2.shape), s2)
