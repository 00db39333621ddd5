"""Wrong variants of vLLM's installed kernels, built at run time (test-the-tester on vLLM).

Each variant is the adapter with one vLLM function wrapped: the wrapper perturbs what the function
receives or returns exactly as its bug would, and never copies vLLM's source. Each overrides only
the stage its bug lives in, so isolated mode must blame that stage alone. The wrapped name is the
one vLLM's own code looks up at call time (a module global), so vLLM's callers see the bug too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from moe_verify.adapters.vllm import VllmBackend
from moe_verify.spec import StageContext

Outputs = dict[str, object]


class _LaunchThen:
    """A @triton.jit kernel whose launch `kernel[grid](*args)` is followed by `after(args)`."""

    def __init__(self, kernel: Any, after: Callable[[tuple[Any, ...]], None]) -> None:
        self.kernel, self.after = kernel, after

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.kernel[grid](*args, **kwargs)
            self.after(args)

        return launch


class OffByOnePrefixSum(VllmBackend):
    """permute: the aligned exclusive prefix sum that seeds ep_scatter's atomic row cursor is one
    row late for every expert after the first (start_e + 1): each of their slots lands one row
    below where m_indices / expert_ends put the segment (`_fwd_kernel_ep_scatter_1`)."""

    def permute(self, ctx: StageContext) -> Outputs:
        dg = self.vllm.dg_utils

        def one_late(args: tuple[Any, ...]) -> None:
            expert_start_loc = args[1]
            expert_start_loc[1:] += 1

        kernel = _LaunchThen(dg._fwd_kernel_ep_scatter_1, one_late)
        with mock.patch.object(dg, "_fwd_kernel_ep_scatter_1", kernel):
            return super().permute(ctx)


class UnzeroedPaddingScales(VllmBackend):
    """permute: the permuted fp32 scales allocated with torch.empty instead of torch.zeros, so
    padding rows keep whatever memory held (vLLM before PR #49784; DeepGEMM's SM100
    packer device-asserts on it). Caught every time only because the harness poisons the
    permute's allocations (moe_verify/run/poison.py)."""

    def permute(self, ctx: StageContext) -> Outputs:
        dg = self.vllm.dg_utils
        with mock.patch.object(dg, "torch", _ZerosAreEmpty()):
            return super().permute(ctx)


class _ZerosAreEmpty:
    """torch, as deep_gemm_utils sees it, with `zeros` allocating uninitialised memory."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, "empty" if name == "zeros" else name)


class PackedScaleBytesReversed(VllmBackend):
    """act_quant: the packed UE8M0 kernel's scale words written with their 4 bytes in reverse
    order (byte j must be group 4p + j, as DeepGEMM's
    `get_mn_major_tma_aligned_packed_ue8m0_tensor` packs them)."""

    def act_quant(self, ctx: StageContext) -> Outputs:
        experts = self.vllm.experts
        packed = experts.fused_silu_mul_fp8_quant_packed

        @functools.wraps(packed)
        def reversed_bytes(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            q, s = packed(*args, **kwargs)
            w = s.to(torch.int64) & 0xFFFFFFFF
            r = sum(((w >> (8 * j)) & 0xFF) << (8 * (3 - j)) for j in range(4))
            s.copy_(torch.where(r >= 2**31, r - 2**32, r).to(torch.int32))
            return q, s

        with mock.patch.object(experts, "fused_silu_mul_fp8_quant_packed", reversed_bytes):
            return super().act_quant(ctx)


class OneSidedUpClamp(VllmBackend):
    """act_quant: up clamped from above only, like the gate, instead of to [-L, L].
    The kernel gets the input already clamped that way and no clamp of its own; with a bf16 L
    that is exactly the kernel with the one-sided clamp."""

    def act_quant(self, ctx: StageContext) -> Outputs:
        experts = self.vllm.experts
        names = ("fused_silu_mul_fp8_quant_packed", "silu_mul_per_token_group_quant_fp8_colmajor")
        with mock.patch.multiple(experts, **{n: _one_sided(getattr(experts, n)) for n in names}):
            return super().act_quant(ctx)


def _one_sided(kernel: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(kernel)
    def run(*, input: torch.Tensor, clamp_limit: float | None, **kwargs: Any) -> Any:
        if clamp_limit is None:
            return kernel(input=input, clamp_limit=None, **kwargs)
        assert float(torch.tensor(clamp_limit).bfloat16()) == clamp_limit, "L must be a bf16 value"
        return kernel(input=input.clamp(max=clamp_limit), clamp_limit=None, **kwargs)

    return run


class MinusOneCheckSkipped(VllmBackend):
    """gather: ep_gather's `expert_id >= 0` check skipped, so a -1 slot is summed too: its weight
    times the row its (uninitialised) inv_perm entry names, here row 0."""

    def gather(self, ctx: StageContext) -> Outputs:
        dg = self.vllm.dg_utils
        gather = dg.ep_gather

        @functools.wraps(gather)
        def unchecked(
            input_tensor: torch.Tensor,
            recv_topk_ids: torch.Tensor,
            recv_topk_weight: torch.Tensor,
            input_index: torch.Tensor,
            expert_map: torch.Tensor | None,
            output_tensor: torch.Tensor,
        ) -> None:
            dead = recv_topk_ids < 0
            # an id the kernel's own check lets through: any expert this rank hosts
            local = 0 if expert_map is None else int((expert_map >= 0).nonzero()[0, 0])
            ids = torch.where(dead, torch.full_like(recv_topk_ids, local), recv_topk_ids)
            rows = torch.where(dead, torch.zeros_like(input_index), input_index)
            gather(input_tensor, ids, recv_topk_weight, rows, expert_map, output_tensor)

        with mock.patch.object(dg, "ep_gather", unchecked):
            return super().gather(ctx)


class GatherWeightsReversed(VllmBackend):
    """gather: ep_gather reads each token's topk weights in reverse k order, so slot k is scaled by
    slot K-1-k's weight."""

    def gather(self, ctx: StageContext) -> Outputs:
        dg = self.vllm.dg_utils
        gather = dg.ep_gather

        @functools.wraps(gather)
        def reversed_weights(
            input_tensor: torch.Tensor,
            recv_topk_ids: torch.Tensor,
            recv_topk_weight: torch.Tensor,
            input_index: torch.Tensor,
            expert_map: torch.Tensor | None,
            output_tensor: torch.Tensor,
        ) -> None:
            weights = recv_topk_weight.flip(1).contiguous()
            gather(input_tensor, recv_topk_ids, weights, input_index, expert_map, output_tensor)

        with mock.patch.object(dg, "ep_gather", reversed_weights):
            return super().gather(ctx)


WRONG_VARIANTS: tuple[type[VllmBackend], ...] = (
    OffByOnePrefixSum,
    UnzeroedPaddingScales,
    PackedScaleBytesReversed,
    OneSidedUpClamp,
    MinusOneCheckSkipped,
    GatherWeightsReversed,
)
