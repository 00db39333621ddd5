"""Every golden stage on a case small enough to compute by hand.

2 tokens, 2 experts, H = I = 128, identity-like weights: expert e multiplies by (e + 1). Values are
chosen so every quantization step is exact, so each expected tensor below is written out, not
computed by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_verify.spec import Activation, MoEInputs, MoEProblem, QuantizedWeight, Routing, Trace
from reference.moe import ReferenceBackend

pytestmark = pytest.mark.cpu

H = I = 128  # noqa: E741 - the paper names: hidden, intermediate
FP8 = torch.float8_e4m3fn
TinyTrace = tuple[MoEProblem, MoEInputs, Trace]


def _identity_stack(scale: list[float], rows: int, cols: int) -> QuantizedWeight:
    """Expert e = scale[e] * [I; I] (or I): fp8 code 448 on the diagonal, block scale scale/448."""
    e = len(scale)
    q = torch.zeros(e, rows, cols)
    for r in range(rows):
        q[:, r, r % cols] = 448.0
    s = torch.tensor(scale).view(e, 1, 1) / 448.0
    s = s.expand(e, rows // 128, cols // 128).contiguous()
    return QuantizedWeight(q.to(FP8), s, (128, 128))


def _tiny_case(
    topk_ids: list[list[int]], weights: list[list[float]]
) -> tuple[MoEProblem, MoEInputs]:
    problem = MoEProblem(
        tokens=2,
        hidden=H,
        intermediate=I,
        num_experts=2,
        topk=len(topk_ids[0]),
        routing=Routing.UNIFORM,
        activation=Activation(),
    )
    x = torch.ones(2, H)
    x[0, 0] = 448.0  # token 0: amax 448 -> scale exactly 1
    x[1] *= 2.0  # token 1: amax 2 -> scale 2/448
    w13 = _identity_stack([1.0, 2.0], 2 * I, H)
    w2 = _identity_stack([1.0, 2.0], H, I)
    inputs = MoEInputs(
        hidden_states=x.to(torch.bfloat16),
        router_logits=torch.zeros(2, 2),
        score_bias=None,
        topk_ids=torch.tensor(topk_ids, dtype=torch.int32),
        topk_weights=torch.tensor(weights),
        w13=torch.zeros(2, 2 * I, H, dtype=torch.bfloat16),
        w2=torch.zeros(2, H, I, dtype=torch.bfloat16),
        w13_q=w13,
        w2_q=w2,
    )
    return problem, inputs


@pytest.fixture
def trace_k1() -> TinyTrace:
    problem, inputs = _tiny_case([[1], [0]], [[1.0], [1.0]])
    return problem, inputs, ReferenceBackend().run(problem, inputs)


def test_route_passes_fixed_ids_through(trace_k1: TinyTrace) -> None:
    _, _, t = trace_k1
    assert t["route"]["topk_ids"].tolist() == [[1], [0]]
    assert t["route"]["topk_weights"].tolist() == [[1.0], [1.0]]


def test_quant_input_is_exact(trace_k1: TinyTrace) -> None:
    _, _, t = trace_k1
    q, s = t["quant_input"]["a1q"], t["quant_input"]["a1q_scale"]
    two_over_448 = (torch.tensor(2.0) / 448.0).item()  # fp32 division, as the recipe does
    assert s.tolist() == [[1.0], [two_over_448]]
    assert q[0, 0].float().item() == 448.0 and q[0, 1].float().item() == 1.0
    assert torch.all(q[1].float() == 448.0)


def test_align_uses_the_upper_bound(trace_k1: TinyTrace) -> None:
    _, _, t = trace_k1
    # M*k = 2 slots, min(2, E_l=2) active experts: round_up(2 + 2*127, 128) = 256.
    assert t["align"]["M_sum"] == 256
    assert t["align"]["counts"].tolist() == [1, 1]


def test_permute_layout(trace_k1: TinyTrace) -> None:
    _, _, t = trace_k1
    perm = t["permute"]
    expected = [0] + [-1] * 127 + [1] + [-1] * 127
    assert perm["m_indices"].tolist() == expected
    assert perm["inv_perm"].tolist() == [[128], [0]]  # token 0 -> expert 1's segment
    assert perm["expert_start"].tolist() == [0, 128]
    assert torch.equal(
        perm["a_perm"][128].view(torch.uint8), t["quant_input"]["a1q"][0].view(torch.uint8)
    )
    assert perm["a_scale_perm"][1:128].abs().sum().item() == 0.0  # padding scales exactly zero


def test_gemm1_identity_weights(trace_k1: TinyTrace) -> None:
    _, _, t = trace_k1
    mm1 = t["gemm1"]["mm1"].float()
    # row 128 = token 0 through expert 1 (x2): gate and up both 2*x0.
    assert mm1[128, 0].item() == 896.0 and mm1[128, 1].item() == 2.0
    assert mm1[128, I].item() == 896.0
    # row 0 = token 1 through expert 0 (x1): all 2.
    assert torch.all(mm1[0] == 2.0)
    assert mm1[1:128].abs().sum().item() == 0.0


def test_act_quant_silu_values(trace_k1: TinyTrace) -> None:
    _, _, t = trace_k1
    q, s = t["act_quant"]["a2q"], t["act_quant"]["a2q_scale"]
    # Token 1, expert 0: g = u = 2 -> y = silu(2) * 2, rounded through bf16 three times (colmajor).
    silu2 = 2.0 / (1.0 + math.exp(-2.0))
    glu = torch.tensor(silu2).to(torch.bfloat16).float()
    y = (glu * 2.0).to(torch.bfloat16).float()
    # fp32 amax x fp32(1/448), as the colmajor kernel computes it
    scale = y * torch.tensor(1.0 / 448.0)
    assert s[0, 0].item() == scale.item()
    assert torch.all(q[0].float() == 448.0)  # every element is the group max


def test_gemm2_and_gather(trace_k1: TinyTrace) -> None:
    _, _, t = trace_k1
    mm2 = t["gemm2"]["mm2"].float()
    a2 = t["act_quant"]["a2q"].float() * t["act_quant"]["a2q_scale"].float()[:, :1]
    # w2 of expert 0 is the identity: mm2 row 0 = dequantized a2 row 0 (bf16-rounded).
    assert torch.equal(mm2[0], a2[0].to(torch.bfloat16).float())
    out = t["gather"]["out"].float()
    assert torch.equal(out[1], mm2[0])  # token 1, one slot, weight 1
    assert torch.equal(out[0], mm2[128])


def test_gather_weights_and_invalid_slots() -> None:
    problem, inputs = _tiny_case([[0, 1], [-1, -1]], [[0.25, 0.75], [0.5, 0.5]])
    t = ReferenceBackend().run(problem, inputs)
    mm2 = t["gemm2"]["mm2"].float()
    rows = t["permute"]["inv_perm"][0].long()
    expected = (0.25 * mm2[rows[0]] + 0.75 * mm2[rows[1]]).to(torch.bfloat16)
    assert torch.equal(t["gather"]["out"][0], expected)
    assert torch.all(t["gather"]["out"][1] == 0)  # a token with no expert is exact zeros
    assert t["permute"]["inv_perm"][1].tolist() == [-1, -1]
