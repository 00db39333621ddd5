"""The golden's TensorRT-LLM act_quant recipe, "colmajor_ceil_packed": the DeepGEMM MoE's
silu_and_mul_masked_post_quant_fwd(scale_ue8m0=True) (docs/tolerance.md#act_quant-recipes).

Hand-computed words first (bf16 has 8 significant bits, e4m3 4: its step is 32 in [256, 512)),
then the golden against the kernel's arithmetic written op for op in torch
(moe_verify/examples/ceil_packed.py, which imports nothing of the golden), pad bytes included.
"""

from __future__ import annotations

import pytest
import torch

from moe_verify.examples.ceil_packed import silu_and_mul_ceil_packed
from moe_verify.spec import Activation, ActQuantRecipe, ScaleFmt
from reference.activation import act_quant
from reference.formats import ceil_pow2_via_log2, ceil_ue8m0, unpack_ue8m0
from tests.reference.test_recipes import bits, every_bf16

pytestmark = pytest.mark.cpu

SILU = Activation()
PACKED = ScaleFmt.UE8M0_PACKED
RECIPE = ActQuantRecipe.COLMAJOR_CEIL_PACKED
BF16 = torch.bfloat16


def ceil_packed(mm1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return act_quant(mm1, SILU, 128, PACKED, RECIPE)


def word(*groups: int) -> int:
    """One int32 word from its bytes, byte j = group 4w + j (little-endian, as DeepGEMM reads)."""
    value = sum(b << (8 * j) for j, b in enumerate(groups))
    return value - (1 << 32) if value >= 1 << 31 else value


# I = 3 groups of 128: group 0 y = 64 * 21 = 1344, group 1 zero, group 2 y = -224. silu(64) is 64
# in fp32 (exp(-64) vanishes next to 1), so every rounding gives these y exactly.
def three_group_rows(rows: int = 1) -> torch.Tensor:
    mm1 = torch.zeros(rows, 2 * 384)
    mm1[:, 0], mm1[:, 384] = 64.0, 21.0
    mm1[:, 256], mm1[:, 384 + 256] = 64.0, -3.5
    return mm1.to(BF16)


def test_three_groups_one_pad_slot() -> None:
    # group 0: 1344 / 448 = 3, not a power of two: the ceil gives 4 (byte 129), and 1344 / 4 =
    # 336, an e4m3 tie between 320 and 352 -> 320 (even). group 1: zero, amax floored at 1e-10:
    # 1e-10 / 448 = 2^-42.03 -> 2^-42 (byte 85), codes 0. group 2: 224 / 448 = 0.5 exactly,
    # no ceil step (byte 126), -224 / 0.5 = -448. Slot 3 (pad): the kernel's zeros, byte 85.
    q, s = ceil_packed(three_group_rows())
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 384)
    assert q.float()[0, [0, 128, 256]].tolist() == [320.0, 0.0, -448.0]
    assert int(q.float().count_nonzero()) == 2
    assert s.dtype == torch.int32 and s.shape == (1, 1) and s.stride() == (1, 4)
    assert s.item() == word(129, 85, 126, 85) == 0x557E5581
    # vLLM's packed kernel floors the SCALE at 1e-10: its zero group and pad slot are byte 94
    assert act_quant(three_group_rows(), SILU, 128, PACKED)[1].item() == word(129, 94, 126, 94)


@pytest.mark.parametrize(
    ("groups", "words"),
    [
        # y = bf16(bf16(silu(1)) * 1) = 0.73046875; 0.73046875 / 448 = 2^-9.26 -> 2^-9 (byte
        # 118 = 0x76), code 0.73046875 * 512 = 374 -> 384; pad slots byte 85 (0x55)
        pytest.param(1, [word(118, 85, 85, 85)], id="G1-three-pad"),
        pytest.param(4, [word(118, 118, 118, 118)], id="G4-no-pad"),
        pytest.param(5, [word(118, 118, 118, 118), word(118, 85, 85, 85)], id="G5-two-words"),
        pytest.param(6, [word(118, 118, 118, 118), word(118, 118, 85, 85)], id="G6-two-pad"),
    ],
)
def test_pad_bytes_of_a_partial_last_word(groups: int, words: list[int]) -> None:
    q, s = ceil_packed(torch.ones(2, 2 * 128 * groups, dtype=BF16))
    assert bool((q.float() == 384.0).all())
    assert s.shape == (2, len(words)) and s.stride() == (1, 4)
    assert s.tolist() == [words, words]
    assert not bool(s.as_strided((len(words) * 4,), (1,)).view(-1, 4)[:, 2:].any())  # TMA rows


def test_batched_leading_dims() -> None:
    # [E_l=2, M_max=3, 2I]: expert 0 the three-group rows, expert 1 all zeros. Each expert packs
    # like the 2-D call, the batches one after the other: strides (P * round_up(3, 4), 1, 4).
    mm1 = torch.stack((three_group_rows(3), torch.zeros(3, 2 * 384, dtype=BF16)))
    q, s = ceil_packed(mm1)
    assert q.shape == (2, 3, 384) and s.shape == (2, 3, 1) and s.stride() == (4, 1, 4)
    assert s[0].flatten().tolist() == [0x557E5581] * 3
    assert s[1].flatten().tolist() == [word(85, 85, 85, 85)] * 3
    for e in range(2):
        q2, s2 = ceil_packed(mm1[e])
        assert torch.equal(bits(q[e]), bits(q2)) and torch.equal(s[e], s2)


def mm1_inputs(seed: int, rows: int = 48, groups: int = 5) -> torch.Tensor:
    """N(0, 4) [gate | up] with an all-zero row and a row below the amax floor (1e-11)."""
    g = torch.Generator().manual_seed(seed)
    mm1 = torch.randn(rows, 2 * 128 * groups, generator=g) * 2
    mm1[0] = 0.0
    mm1[1] *= 1e-11
    return mm1.to(BF16)


@pytest.mark.parametrize("groups", [2, 5, 8])
def test_golden_is_the_kernels_arithmetic(groups: int) -> None:
    # The kernel floors amax at bf16(1e-10) (Triton keeps the bf16 type), the golden at fp32
    # 1e-10; both give 2^-42 after the ceiling. Its pad slots are computed from zeros: byte 85.
    mm1 = mm1_inputs(seed=groups, groups=groups)
    q, s = ceil_packed(mm1)
    q_k, s_k = silu_and_mul_ceil_packed(mm1)
    assert torch.equal(bits(q), bits(q_k))
    assert s.stride() == s_k.stride() and torch.equal(s, s_k)  # whole words: pad bytes too
    assert bool((unpack_ue8m0(s, groups)[0] == 85).all())


def test_the_recipe_is_neither_packed_nor_colmajor() -> None:
    # vLLM's packed kernel rounds y once (not after silu), so codes differ; colmajor writes fp32.
    mm1 = mm1_inputs(seed=7)
    q, s = ceil_packed(mm1)
    q_p, s_p = act_quant(mm1, SILU, 128, PACKED, ActQuantRecipe.PACKED)
    assert not torch.equal(bits(q), bits(q_p))
    assert not torch.equal(s, s_p)  # at least the zero row's bytes: 85 here, 94 there
    q_c, s_c = act_quant(mm1, SILU, 128, ScaleFmt.FLOAT32_CEIL_UE8M0, ActQuantRecipe.COLMAJOR)
    assert torch.equal(bits(q), bits(q_c))  # colmajor's ceil quantization, packed
    assert torch.equal(unpack_ue8m0(s, 5), (bits(s_c) >> 23).to(torch.uint8))


def test_division_and_reciprocal_ceil_alike_on_every_bf16_amax() -> None:
    # The kernel divides amax by 448 and rounds up through exp2(ceil(log2)); colmajor's scale is
    # amax * fp32(1/448) rounded up on the bits. amax / 448 is a power of two exactly (amax =
    # 7 * 2^j) or at least 2^-8 (relative) away from one, so all three agree.
    amax = every_bf16().clamp(min=1e-10)
    division = amax / torch.full_like(amax, 448.0)
    reciprocal = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    assert torch.equal(bits(ceil_ue8m0(division)), bits(ceil_ue8m0(reciprocal)))
    assert torch.equal(bits(ceil_pow2_via_log2(division)), bits(ceil_ue8m0(division)))
