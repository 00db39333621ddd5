"""Triton group quantizers and UE8M0 packers vs the golden (reference/formats.py), bit for bit.

Quantization is a deterministic function of its input on both sides (same division, same
bit-level power-of-two rounding, RNE casts), so codes, scales and packed words must be identical:
no tolerance applies (policy: quant_input and permute are "exact"). fp8 codes compare as uint8
views, scales as fp32 bit patterns, packed words as int32 (both sides pad with byte 0 here).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from moe_verify.common.device import default_device
from moe_verify.spec import ScaleFmt
from optimized.kernels import quant
from optimized.kernels._validate import InvalidKernelInput
from reference import formats as golden

pytestmark = pytest.mark.cpu

FP8 = torch.float8_e4m3fn


def generator(case_id: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(case_id.encode()))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns on the CPU (fp8 -> uint8, fp32 -> int32, int32 unchanged)."""
    t = t.cpu()
    if t.dtype == FP8:
        return t.view(torch.uint8)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_bitwise(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    got, expected = bits(got), bits(expected)
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} vs {expected.shape}"
    differ = got != expected
    if bool(differ.any()):
        at = tuple(int(i) for i in differ.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(differ.sum())} of {differ.numel()} differ; first at {at}: kernel "
            f"{got[at].item():#x}, golden {expected[at].item():#x}"
        )


def activations(case_id: str, m: int, k: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[m, k] values spanning 2^-12..2^12 per row, with edge groups in the first rows:
    row 0 group 0 all zero (the eps floor), row 1 group 0 amax exactly 448 * 2^-4 (s an exact
    power of two: ceil must not move it), row 2 group 0 tiny (s below the 1e-10 UE8M0 floor),
    row 3 group 0 amax one bf16 ulp above 448 * 2^-4 (ceil rounds up a whole step)."""
    g = generator(case_id)
    row_scale = torch.exp2(torch.randint(-12, 13, (m, 1), generator=g).float())
    x = torch.randn(m, k, generator=g) * row_scale
    edges = {0: 0.0, 1: 28.0, 2: 1e-9, 3: 28.125}
    for row, amax in edges.items():
        if row < m and k:
            x[row, :group] = torch.linspace(-amax, amax / 2, group)
    return x.to(dtype)


# (M, K, group, input dtype) -- each row names the edge it exercises.
GROUP_CASES = [
    (1, 128, 128, torch.bfloat16),  # T=1, a single group
    (3, 384, 128, torch.bfloat16),  # odd M, three groups
    (128, 384, 128, torch.bfloat16),  # M a multiple of the row tile
    (257, 384, 128, torch.bfloat16),  # M = 2*128 + 1: partial row tile, M % 4 != 0
    (257, 2880, 32, torch.bfloat16),  # K = 2880 (gpt-oss hidden): 90 groups of 32
    (5, 2880, 64, torch.bfloat16),  # group 64, K = 45 groups
    (7, 256, 128, torch.float32),  # fp32 input: full 24-bit mantissas reach x / s
    (7, 256, 128, torch.float16),  # fp16 input
    (0, 256, 128, torch.bfloat16),  # M = 0: no launch, empty outputs
]
FMTS = list(ScaleFmt)


def _case_id(m: int, k: int, group: int, dtype: torch.dtype) -> str:
    return f"M{m}-K{k}-g{group}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("scale_fmt", FMTS, ids=str)
@pytest.mark.parametrize(
    ("m", "k", "group", "dtype"), GROUP_CASES, ids=[_case_id(*c) for c in GROUP_CASES]
)
def test_quantize_fp8_groups_matches_golden(
    m: int, k: int, group: int, dtype: torch.dtype, scale_fmt: ScaleFmt
) -> None:
    x = activations(_case_id(m, k, group, dtype), m, k, group, dtype)
    q, s = quant.quantize_fp8_groups(x.to(default_device()), group, scale_fmt)
    q_ref, s_ref = golden.quantize_fp8_groups(x, group, scale_fmt)
    assert s.stride() == (k // group, 1), f"row-major scales expected, got {s.stride()}"
    assert_bitwise("q", q, q_ref)
    assert_bitwise("scale", s, s_ref)


# (layout, M) -- the scale storage variants of vLLM's per_token_group_quant_fp8.
LAYOUTS = [
    ("column_major", 257, (1, 257)),  # strides (1, M)
    ("column_major_tma", 257, (1, 260)),  # strides (1, round_up(M, 4)): 3 pad rows
    ("column_major_tma", 128, (1, 128)),  # already aligned
]


@pytest.mark.parametrize("scale_fmt", FMTS, ids=str)
@pytest.mark.parametrize(
    ("layout", "m", "strides"), LAYOUTS, ids=[f"{c[0]}-M{c[1]}" for c in LAYOUTS]
)
def test_quantize_fp8_groups_scale_layouts(
    layout: str, m: int, strides: tuple[int, int], scale_fmt: ScaleFmt
) -> None:
    x = activations(f"{layout}-M{m}", m, 384, 128, torch.bfloat16)
    q, s = quant.quantize_fp8_groups(
        x.to(default_device()),
        128,
        scale_fmt,
        column_major=True,
        tma_aligned=layout.endswith("tma"),
    )
    q_ref, s_ref = golden.quantize_fp8_groups(x, 128, scale_fmt)
    assert s.stride() == strides
    assert_bitwise("q", q, q_ref)
    assert_bitwise("scale", s, s_ref)


# (M, K, group) -- packed ceil-UE8M0 (vLLM's per_token_group_quant_fp8_packed_for_deepgemm).
PACKED_CASES = [
    (1, 128, 128),  # one group: one word, three pad bytes
    (3, 384, 128),  # G = 3: one pad byte
    (128, 512, 128),  # G = 4: exactly one full word
    (257, 2880, 32),  # G = 90: 23 words, 2 pad bytes; M % 4 != 0 (TMA pad rows)
    (0, 256, 128),  # M = 0
]


@pytest.mark.parametrize(
    ("m", "k", "group"), PACKED_CASES, ids=[f"M{m}-K{k}-g{g}" for m, k, g in PACKED_CASES]
)
def test_quantize_fp8_groups_packed_matches_golden(m: int, k: int, group: int) -> None:
    x = activations(f"packed-M{m}-K{k}-g{group}", m, k, group, torch.bfloat16)
    q, packed = quant.quantize_fp8_groups_packed(x.to(default_device()), group)
    q_ref, s_ref = golden.quantize_fp8_groups(x, group, ScaleFmt.UE8M0_PACKED)
    num_groups = k // group
    assert packed.shape == (m, -(-num_groups // 4))
    assert packed.stride() == (1, -(-m // 4) * 4)
    assert_bitwise("q", q, q_ref)
    # The golden packer pads with byte 0, as vLLM's CUDA packed quantizer does: whole words match.
    assert_bitwise("packed scale", packed, golden.pack_ue8m0(golden.ue8m0_bytes(s_ref)))


# (M, K) -- MXFP8, 1x32 groups with E8M0 bytes (FlashInfer's mxfp8_quantize).
MX_CASES = [
    (1, 32, "random"),  # T=1, one group
    (3, 384, "random"),  # 12 groups
    (257, 2880, "random"),  # 90 groups, partial row tile
    (6, 128, "extremes"),  # zero, -0, bf16 subnormal and near-max groups: bytes 0, 1 and 247
    (0, 64, "random"),  # M = 0
]


def mx_input(m: int, k: int, kind: str) -> torch.Tensor:
    x = activations(f"mx-M{m}-K{k}-{kind}", m, k, 32, torch.float32)
    if kind == "extremes":
        x[0, :32] = 0.0  # amax == 0 -> byte 0, q = 0
        x[1, :32] = -0.0  # still amax == 0; q keeps the sign (x * 0)
        x[2, :32] = 2.0**-133  # bf16 subnormal: SF <= 2^-127 -> byte 0 (saturated ceil)
        x[3, :32] = 2.0**-118  # SF = 2^-126.8, in (2^-127, 2^-126] -> byte 1
        x[4, :32] = 3.0e38  # near the bf16 max: SF = 2^119.01 -> byte 247
        x[5, :32] = 448.0 * 2.0**-3  # 56 * fp32(1/448) rounds to exactly 2^-3 -> byte 124
    return x.to(torch.bfloat16)


@pytest.mark.parametrize(
    ("m", "k", "kind"), MX_CASES, ids=[f"M{m}-K{k}-{kind}" for m, k, kind in MX_CASES]
)
def test_quantize_mxfp8_matches_golden(m: int, k: int, kind: str) -> None:
    x = mx_input(m, k, kind)
    q, e8m0 = quant.quantize_mxfp8(x.to(default_device()))
    q_ref, e8m0_ref = golden.quantize_mxfp8(x)
    assert_bitwise("q", q, q_ref)
    assert_bitwise("E8M0 bytes", e8m0, e8m0_ref)
    if kind == "extremes":
        assert e8m0[:6, 0].cpu().tolist() == [0, 0, 0, 1, 247, 124]


# (shape, strides of the input view) -- pack_ue8m0 of E8M0 bytes.
PACK_CASES = [
    ("MN1-G1", (1, 1), False),  # one byte: three pad bytes in the only word
    ("MN3-G3", (3, 3), False),  # MN % 4 != 0: TMA pad rows in storage
    ("MN5-G8", (5, 8), False),  # G a multiple of 4: no pad bytes
    ("MN257-G90", (257, 90), False),  # MXFP8 activations at K = 2880
    ("MN128-G56-transposed", (128, 56), True),  # a column-major input view: strides honoured
    ("B4-MN3-G5", (4, 3, 5), False),  # batched [E, MN, G] (weights)
    ("MN0-G4", (0, 4), False),  # empty
]


@pytest.mark.parametrize(
    ("shape", "transposed"), [c[1:] for c in PACK_CASES], ids=[c[0] for c in PACK_CASES]
)
def test_pack_ue8m0_matches_golden(shape: tuple[int, ...], transposed: bool) -> None:
    g = generator(f"pack-{shape}-{transposed}")
    full = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    src = full.t().contiguous().t() if transposed else full
    packed = quant.pack_ue8m0(src.to(default_device()))
    expected = golden.pack_ue8m0(full)
    assert packed.stride() == expected.stride()
    assert_bitwise("packed", packed, expected)


@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "column-major-tma"])
def test_pack_ue8m0_from_fp32_matches_golden(transposed: bool) -> None:
    # Scales as SM90 kernels produce them: ceil-UE8M0 fp32, possibly in a column-major TMA view.
    x = activations(f"from-fp32-{transposed}", 257, 2880, 32, torch.bfloat16)
    _, scale = quant.quantize_fp8_groups(
        x.to(default_device()), 32, ScaleFmt.FLOAT32_CEIL_UE8M0, column_major=transposed,
        tma_aligned=transposed,
    )  # fmt: skip
    scale[5, 7] = 0.0  # +0 is accepted (byte 0), as DeepGEMM's assert allows
    packed = quant.pack_ue8m0_from_fp32(scale)
    expected = golden.pack_ue8m0(golden.ue8m0_bytes(scale.cpu()))
    assert_bitwise("packed", packed, expected)


# (value, what it is) -- scales DeepGEMM's fp32 packer would trap on.
BAD_SCALES = [
    (3.0, "not a power of two"),
    (-0.5, "negative"),
    (-0.0, "negative zero"),
    (2.0**-130, "subnormal power of two"),
    (float("inf"), "infinity (byte 0xFF, NaN to the GEMM)"),
    (float("nan"), "NaN"),
]


@pytest.mark.parametrize("value", [v for v, _ in BAD_SCALES], ids=[w for _, w in BAD_SCALES])
def test_pack_ue8m0_from_fp32_rejects(value: float) -> None:
    scale = torch.full((6, 9), 0.25)
    scale[4, 7] = value
    scale[5, 8] = value  # a later offender must not be the one named
    with pytest.raises(InvalidKernelInput, match=r"scale\[row=4, group=7\]") as info:
        quant.pack_ue8m0_from_fp32(scale.to(default_device()))
    assert "2 such scales" in str(info.value)


def test_pack_ue8m0_from_fp32_validate_false_skips_the_check() -> None:
    scale = torch.full((4, 4), 3.0)  # exponent field 128 (the mantissa is dropped, unchecked)
    packed = quant.pack_ue8m0_from_fp32(scale.to(default_device()), validate=False)
    assert golden.unpack_ue8m0(packed.cpu(), 4).unique().tolist() == [128]


# (case, call, what the message must say) -- each wrapper names the argument it refuses.
def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bfloat16, device=default_device())


def _zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=default_device())


BAD_CALLS = [
    (
        "K-not-a-multiple-of-group",
        lambda: quant.quantize_fp8_groups(_bf16(4, 200), 128),
        r"x\.shape\[1\] \(K\)=200 must be a multiple of group=128",
    ),
    (
        "group-96",
        lambda: quant.quantize_fp8_groups(_bf16(4, 192), 96),
        r"group must be one of \[32, 64, 128\]",
    ),
    (
        "int32-input",
        lambda: quant.quantize_fp8_groups(_zeros(4, 128, dtype=torch.int32), 128),
        r"x must be bfloat16 or float16 or float32, got torch.int32",
    ),
    ("3d-input", lambda: quant.quantize_fp8_groups(_bf16(2, 4, 128), 128), r"x must be 2-D"),
    (
        "strided-columns",
        lambda: quant.quantize_fp8_groups(_bf16(128, 4).t(), 128),
        r"x must have unit stride along its last dimension",
    ),
    (
        "tma-without-column-major",
        lambda: quant.quantize_fp8_groups(_bf16(4, 128), 128, tma_aligned=True),
        r"tma_aligned=True needs column_major=True",
    ),
    (
        "packed-group-64",
        lambda: quant.quantize_fp8_groups_packed(_bf16(4, 128), 64),
        r"group must be one of \[32, 128\]",
    ),
    (
        "mxfp8-group-128",
        lambda: quant.quantize_mxfp8(_bf16(4, 128), 128),
        r"group must be one of \[32\]",
    ),
    (
        "pack-int32-bytes",
        lambda: quant.pack_ue8m0(_zeros(4, 4, dtype=torch.int32)),
        r"exponent_bytes must be uint8",
    ),
    (
        "pack-from-fp32-1d",
        lambda: quant.pack_ue8m0_from_fp32(_zeros(4, dtype=torch.float32)),
        r"scale must be 2-D or 3-D",
    ),
]


@pytest.mark.parametrize(
    ("call", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_inputs_are_refused_before_launch(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
