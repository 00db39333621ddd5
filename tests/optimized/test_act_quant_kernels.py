"""Triton fused SwiGLU + FP8 quant (`silu_mul_quant`) vs the golden `reference.activation`.

Under the interpreter the comparison is bitwise, with the interpreter's `tl.exp` routed through
torch.exp (the golden's exp; see optimized.triton_compat.torch_exp_in_interpreter): everything
else (clamp, the order and number of bf16 roundings, amax, scale floors, ceil, RNE casts, packing,
pad bytes) is then the same arithmetic on both sides, so any difference is a recipe bug. Natively,
`tl.exp` is the GPU's approximation and the comparison takes the policy's act_quant
bound instead (tolerance.policy). fp8 codes compare as uint8, fp32 scales as bits, packed scales
as their unpacked bytes including the pad slots (byte 94, as the packed kernel writes them).
"""

from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

from moe_verify.common.device import default_device, interpreter_mode
from moe_verify.spec import Activation, MoEProblem, Recipe, ScaleFmt
from optimized.kernels.act_quant import silu_mul_quant
from optimized.triton_compat import torch_exp_in_interpreter
from reference import activation as golden
from reference import formats
from tolerance import metrics
from tolerance.policy import policy_for

pytestmark = pytest.mark.cpu

FP8 = torch.float8_e4m3fn
LIMIT = 7.05  # not a bf16 number (bf16 neighbours 7.03125 and 7.0625): the two recipes differ

ACTIVATIONS = [
    Activation(),  # silu
    Activation(limit=LIMIT),  # silu with a clamp that bf16 cannot represent
    Activation("swigluoai", 1.702, 1.0, 7.0),  # gpt-oss: alpha, beta and limit all active
]

# (M, I, group) -- each row names the edge it exercises.
SHAPES = [
    (1, 128, 128),  # T=1, one group: packed word has three pad slots
    (3, 384, 128),  # odd M, G=3: one pad slot
    (128, 256, 128),  # M a multiple of 128 (vLLM's colmajor precondition holds)
    (257, 384, 128),  # M % 4 != 0 (TMA pad rows), M % 128 != 0 (sharp edge 9: vLLM asserts)
    (5, 128, 32),  # MXFP8 act group 32: G=4, exactly one word
    (3, 96, 32),  # group 32, G=3
    (0, 256, 128),  # M_sum == 0: no launch with an empty grid
]


def mm1_input(case_id: str, m: int, inter: int) -> torch.Tensor:
    """bf16 [m, 2I]: |x| up to ~16, so swapping gate and up changes silu(g)*u, with the clamp
    straddled on both sides and one all-zero group (row 0, group 0)."""
    g = torch.Generator().manual_seed(zlib.crc32(case_id.encode()))
    x = torch.randn(m, 2 * inter, generator=g) * 4.0
    if m >= 3:
        # Row 1: gate far below -L (must not be clamped from below) and up beyond -L and +L.
        x[1, :8] = torch.tensor([-20.0, -9.0, 7.03125, 7.0625, 8.0, 30.0, -7.0625, 0.5])
        x[1, inter : inter + 8] = torch.tensor([7.0625, -7.0625, 30.0, -30.0, 2.0, 7.03125, 1, -1])
    if m >= 1:
        first = min(inter, 128)  # the first group (of 128 or of 32) of both halves
        x[0, :first] = 0.0
        x[0, inter : inter + first] = 0.0
    return x.to(torch.bfloat16)


def case_id(m: int, inter: int, group: int, act: Activation, fmt: ScaleFmt) -> str:
    return f"M{m}-I{inter}-g{group}-{act.tag}-{fmt}"


CASES = [(s, a, f) for s in SHAPES for a in ACTIVATIONS for f in ScaleFmt]


@contextlib.contextmanager
def same_exp_as_golden():
    """Interpreted: tl.exp = torch.exp, so the comparison can be bitwise. Native: nothing."""
    if interpreter_mode():
        with torch_exp_in_interpreter():
            yield
    else:
        yield


def scale_values(scale: torch.Tensor, fmt: ScaleFmt, num_groups: int) -> torch.Tensor:
    """Per-group scale as fp32 [M, G] (packed: 2^(byte-127) of the unpacked bytes)."""
    scale = scale.cpu()
    if fmt is not ScaleFmt.UE8M0_PACKED:
        return scale.contiguous()
    return formats.e8m0_to_fp32(formats.unpack_ue8m0(scale, num_groups))


def assert_within_policy(q, s, q_ref, s_ref, group: int, fmt: ScaleFmt, act: Activation) -> None:
    """Native only: the policy's act_quant bound (tl.exp is not torch.exp on a GPU)."""
    problem = MoEProblem(
        hidden=128, intermediate=128, recipe=Recipe.FP8_BLOCK, scale_fmt=fmt, activation=act
    )
    check = policy_for("act_quant", problem)
    if s.numel() == 0:
        return
    flips = s != s_ref
    assert flips.float().mean().item() <= check.limit("scale_flip_frac").value
    if bool(flips.any()):
        step = torch.maximum(s, s_ref) / torch.minimum(s, s_ref) - 1
        assert step.max().item() <= check.limit("scale_step").value
    s_el = s.repeat_interleave(group, dim=1)
    s_ref_el = s_ref.repeat_interleave(group, dim=1)
    code_dist = metrics.fp8_code_distance(q, q_ref).double()
    value_dist = metrics.fp8_value_distance(q, s_el, q_ref, s_ref_el)
    dist = torch.where(s_el == s_ref_el, code_dist, value_dist)
    assert dist.max().item() <= check.limit("code_dist").value
    assert (dist > 0).float().mean().item() <= check.limit("code_frac").value


@pytest.mark.parametrize(
    ("shape", "act", "fmt"), CASES, ids=[case_id(*s, a, f) for s, a, f in CASES]
)
def test_silu_mul_quant_matches_golden(
    shape: tuple[int, int, int], act: Activation, fmt: ScaleFmt
) -> None:
    m, inter, group = shape
    mm1 = mm1_input(case_id(m, inter, group, act, fmt), m, inter)
    with same_exp_as_golden():
        q, s = silu_mul_quant(mm1.to(default_device()), act, group, fmt)
    q_ref, s_ref = golden.act_quant(mm1, act, group, fmt)
    num_groups = inter // group
    if fmt is ScaleFmt.UE8M0_PACKED:
        assert s.dtype == torch.int32 and s.shape == (m, -(-num_groups // 4))
        assert s.stride() == (1, -(-m // 4) * 4), f"packed scales need TMA strides, {s.stride()}"
    else:
        assert s.dtype == torch.float32 and s.shape == (m, num_groups)
        assert s.stride() == (1, m), f"colmajor scales are column-major, got {s.stride()}"
    assert q.dtype == FP8 and q.shape == (m, inter)
    q, s_cpu = q.cpu(), s.cpu()
    if not interpreter_mode():
        s_val = scale_values(s_cpu, fmt, num_groups)
        s_ref_val = scale_values(s_ref, fmt, num_groups)
        assert_within_policy(q, s_val, q_ref, s_ref_val, group, fmt, act)
        return
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    if bool(differ.any()):
        at = tuple(int(i) for i in differ.nonzero()[0])
        pytest.fail(
            f"a2q: {int(differ.sum())} of {differ.numel()} codes differ; first at (row, col) {at}:"
            f" kernel {int(q.view(torch.uint8)[at]):#04x}, golden "
            f"{int(q_ref.view(torch.uint8)[at]):#04x}, mm1 gate {mm1[at[0], at[1]].item()} "
            f"up {mm1[at[0], inter + at[1]].item()}"
        )
    if fmt is ScaleFmt.UE8M0_PACKED:
        # Compare every byte of every word, pad slots included (both sides write 94 there).
        slots = 4 * s_cpu.shape[1]
        got, want = formats.unpack_ue8m0(s_cpu, slots), formats.unpack_ue8m0(s_ref, slots)
        assert torch.equal(got, want), f"packed scale bytes differ at {(got != want).nonzero()[:4]}"
    else:
        got, want = s_cpu.contiguous().view(torch.int32), s_ref.view(torch.int32)
        assert torch.equal(got, want), f"fp32 scales differ at {(got != want).nonzero()[:4]}"


# The psum layout over 128 rows, A = 32: expert 0 on rows 0..9, expert 1 empty (its end is its
# start, 32), expert 2 on rows 32..69; rows 10..31 and 70..95 are gaps, 96..127 the tail.
PSUM_ENDS, PSUM_ALIGN, PSUM_ROWS = (10, 32, 70), 32, 128


@pytest.mark.parametrize("fmt", list(ScaleFmt), ids=str)
def test_psum_layout_quantizes_live_rows_only(fmt: ScaleFmt) -> None:
    """With expert_ends (vLLM 0.32's `_act_mul_quant(expert_ends, expert_alignment)`) every live
    row comes out as the dense launch computes it, and no gap or tail row is written."""
    act, inter, group = ACTIVATIONS[2], 256, 128
    mm1 = mm1_input(f"psum-{fmt}", PSUM_ROWS, inter).to(default_device())
    ends = torch.tensor(PSUM_ENDS, dtype=torch.int32, device=mm1.device)
    live = torch.zeros(PSUM_ROWS, dtype=torch.bool)
    live[0:10] = live[32:70] = True
    sentinel = torch.full((PSUM_ROWS, inter), 0x5A, dtype=torch.uint8, device=mm1.device)
    with same_exp_as_golden():
        q_dense, s_dense = silu_mul_quant(mm1, act, group, fmt)
        q, s = silu_mul_quant(
            mm1, act, group, fmt, sentinel.clone().view(FP8),
            expert_ends=ends, expert_alignment=PSUM_ALIGN,
        )  # fmt: skip
    q, q_dense = q.cpu().view(torch.uint8), q_dense.cpu().view(torch.uint8)
    assert torch.equal(q[live], q_dense[live])
    assert torch.equal(q[~live], sentinel.cpu()[~live]), "a gap or tail row was written"
    groups = inter // group
    got, want = scale_values(s, fmt, groups), scale_values(s_dense, fmt, groups)
    assert torch.equal(got[live].view(torch.int32), want[live].view(torch.int32))


@pytest.mark.parametrize(
    ("ends", "kwargs", "message"),
    [
        ((10, 5, 70), {"expert_alignment": 32}, "below the start"),  # expert 1 starts at 32
        ((10, 32, 129), {"expert_alignment": 32}, "past the buffer"),
        ((10, 32, 70), {"expert_alignment": 0}, "expert_alignment must be an int >= 1"),
        (None, {"expert_alignment": 32}, "without expert_ends"),
    ],
    ids=["end-below-start", "end-past-M", "no-alignment", "alignment-without-ends"],
)
def test_psum_layout_is_validated(ends, kwargs: dict, message: str) -> None:
    mm1 = torch.zeros(PSUM_ROWS, 256, dtype=torch.bfloat16, device=default_device())
    layout = None if ends is None else torch.tensor(ends, dtype=torch.int32, device=mm1.device)
    with pytest.raises(ValueError, match=message):
        silu_mul_quant(mm1, Activation(), 128, ScaleFmt.FLOAT32, expert_ends=layout, **kwargs)


def test_zero_group_scales() -> None:
    """Row 0, group 0 is all zeros: byte 94 packed; 1e-10 * fp32(1/448) float32; 2^-42 ceil."""
    mm1 = mm1_input("zero-group", 4, 256)
    with same_exp_as_golden():
        _, packed = silu_mul_quant(mm1.to(default_device()), Activation(), 128, "ue8m0_packed")
        _, plain = silu_mul_quant(mm1.to(default_device()), Activation(), 128, "float32")
        _, ceil = silu_mul_quant(mm1.to(default_device()), Activation(), 128, "float32_ceil_ue8m0")
    # Byte 94 = 127 + ceil(log2(1e-10)) = 127 - 33, also in the two pad slots of the only word.
    assert formats.unpack_ue8m0(packed.cpu(), 4)[0].tolist()[0] == 94
    assert formats.unpack_ue8m0(packed.cpu(), 4)[0].tolist()[2:] == [94, 94]
    expected = torch.tensor(1e-10, dtype=torch.float32) * torch.tensor(1 / 448, dtype=torch.float32)
    assert plain[0, 0].item() == expected.item()
    assert ceil[0, 0].item() == 2.0**-42


# Test-the-tester: the bitwise check above must reject the classic wrong kernels on these inputs.
# Each variant computes what a wrong kernel would return, from golden building blocks.
def _wrong_swapped_halves(mm1: torch.Tensor, act: Activation, fmt: ScaleFmt) -> torch.Tensor:
    inter = mm1.shape[1] // 2
    swapped = torch.cat([mm1[:, inter:], mm1[:, :inter]], dim=1)
    return golden.act_quant(swapped, act, 128, fmt)[0]


def _wrong_gate_clamped_below(mm1: torch.Tensor, act: Activation, fmt: ScaleFmt) -> torch.Tensor:
    inter = mm1.shape[1] // 2
    assert act.limit is not None
    clamped = mm1.clone()
    clamped[:, :inter] = clamped[:, :inter].float().clamp(min=-act.limit).bfloat16()
    return golden.act_quant(clamped, act, 128, fmt)[0]


def _wrong_recipe(mm1: torch.Tensor, act: Activation, fmt: ScaleFmt) -> torch.Tensor:
    # The packed format's scale rule applied to the colmajor kernel's three-rounding y.
    y = golden.swiglu(mm1, act, "colmajor")
    groups = y.reshape(y.shape[0], -1, 128)
    scale = formats.ceil_ue8m0((groups.abs().amax(-1) / 448.0).clamp(min=1e-10))
    return formats.cast_to_fp8(groups / scale.unsqueeze(-1)).reshape(y.shape)


WRONG = [
    ("gate-up-swapped", _wrong_swapped_halves, Activation(), ScaleFmt.FLOAT32),
    ("gate-clamped-from-below", _wrong_gate_clamped_below, ACTIVATIONS[2], ScaleFmt.FLOAT32),
    ("colmajor-rounding-for-packed", _wrong_recipe, Activation(limit=LIMIT), ScaleFmt.UE8M0_PACKED),
]


@pytest.mark.parametrize(("wrong", "act", "fmt"), [w[1:] for w in WRONG], ids=[w[0] for w in WRONG])
def test_a_wrong_kernel_would_be_caught(wrong, act: Activation, fmt: ScaleFmt) -> None:
    mm1 = mm1_input("wrong-kernels", 64, 384)
    if wrong is _wrong_recipe:
        # Inputs near the clamp, where one rounding vs three lands on different bf16 values.
        g = torch.Generator().manual_seed(7)
        mm1 = (torch.rand(64, 768, generator=g) * 4 + 5.5).to(torch.bfloat16)
    with same_exp_as_golden():
        q, _ = silu_mul_quant(mm1.to(default_device()), act, 128, fmt)
    assert not torch.equal(q.cpu().view(torch.uint8), wrong(mm1, act, fmt).view(torch.uint8))


def _mm1(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bfloat16, device=default_device())


BAD_CALLS = [
    (
        "odd-2I",
        lambda: silu_mul_quant(_mm1(4, 257), Activation(), 128, "float32"),
        r"mm1\.shape\[1\] = 257 must be even",
    ),
    (
        "I-not-multiple-of-group",
        lambda: silu_mul_quant(_mm1(4, 320), Activation(), 128, "float32"),
        r"I = mm1\.shape\[1\] / 2=160 must be a multiple of group=128",
    ),
    (
        "fp32-mm1",
        lambda: silu_mul_quant(_mm1(4, 256).float(), Activation(), 128, "float32"),
        r"mm1 must be bfloat16",
    ),
    (
        "strided-columns",
        lambda: silu_mul_quant(_mm1(256, 4).t(), Activation(), 128, "float32"),
        r"mm1 must have unit stride",
    ),
    (
        "activation-string",
        lambda: silu_mul_quant(_mm1(4, 256), "silu", 128, "float32"),
        r"activation must be a moe_verify\.spec\.Activation",
    ),
    (
        "group-64",
        lambda: silu_mul_quant(_mm1(4, 256), Activation(), 64, "float32"),
        r"group must be one of \[32, 128\]",
    ),
]


@pytest.mark.parametrize(
    ("call", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_inputs_are_refused_before_launch(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
