"""Wrong variants of LMDeploy's installed kernels, built at run time (test-the-tester on LMDeploy).

Each variant is the adapter with one LMDeploy function wrapped (on the module attribute the
adapter looks up): the wrapper perturbs what the function receives or returns as its bug would,
never copying LMDeploy's source, and overrides only the stage its bug lives in, so isolated mode
must blame that stage. The correct LMDeploy already fails some checks (docs/implementations.md,
findings 3-6); test_lmdeploy_wrong_variants.py asserts each variant adds failing checks of its own.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import torch

from moe_verify.adapters.lmdeploy import LmdeployBackend
from moe_verify.spec import StageContext

Outputs = dict[str, object]
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class QuantScalesFloored(LmdeployBackend):
    """quant_input: the UE8M0 rounding of per_token_group_quant_fp8 takes the floor of log2 of
    amax/448 instead of its ceiling: the scale is up to 2x too small and the group's largest
    values saturate at +-448."""

    def quant_input(self, ctx: StageContext) -> Outputs:
        quant = self.lmd.quant
        original = quant.per_token_group_quant_fp8

        @functools.wraps(original)
        def floored(h: torch.Tensor, group: int, *args: Any, **kwargs: Any) -> Any:
            kwargs["scale_fmt"] = None  # the plain amax/448 scale, then the wrong power of two
            _, scale = original(h, group, *args, **kwargs)
            scale = torch.exp2(torch.floor(torch.log2(scale)))
            grouped = h.float().unflatten(-1, (-1, group)) / scale.unsqueeze(-1)
            codes = grouped.clamp(-FP8_MAX, FP8_MAX).flatten(-2).to(torch.float8_e4m3fn)
            return codes, scale

        with mock.patch.object(quant, "per_token_group_quant_fp8", floored):
            return super().quant_input(ctx)


class QuantScaleFmtDropped(LmdeployBackend):
    """quant_input: the model's scale_fmt='ue8m0' is not passed on to per_token_group_quant_fp8,
    so the input's scales are plain amax/448 where the problem asks for powers of two."""

    def quant_input(self, ctx: StageContext) -> Outputs:
        quant = self.lmd.quant
        original = quant.per_token_group_quant_fp8

        @functools.wraps(original)
        def dropped(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("scale_fmt", None)
            return original(*args, **kwargs)

        with mock.patch.object(quant, "per_token_group_quant_fp8", dropped):
            return super().quant_input(ctx)


class ScatterSlotToNeighbour(LmdeployBackend):
    """permute: ep_scatter_fp8 computes one slot's destination from the next expert's cursor
    (expert + 1): that slot's row, scales and output_index land in the neighbouring expert's
    segment (which has room: DeepEP's counts are aligned up to 128)."""

    def permute(self, ctx: StageContext) -> Outputs:
        ep_fp8 = self.lmd.ep_fp8
        original = ep_fp8.ep_scatter_fp8

        @functools.wraps(original)
        def misplaced(
            a: torch.Tensor, s: torch.Tensor, ids: torch.Tensor, recv: torch.Tensor, *rest: Any
        ) -> Any:
            ids = ids.clone()
            flat, experts = ids.view(-1), recv.numel()
            for slot in range(flat.numel()):
                e = int(flat[slot])
                if e >= 0 and int(recv[(e + 1) % experts]) > 0:
                    flat[slot] = (e + 1) % experts
                    break
            return original(a, s, ids, recv, *rest)

        with mock.patch.object(ep_fp8, "ep_scatter_fp8", misplaced):
            return super().permute(ctx)


class ActGateUpSwapped(LmdeployBackend):
    """act_quant: silu_and_mul reads the gate from the second half of gemm1's output and up from
    the first (silu(up) * gate instead of silu(gate) * up)."""

    def act_quant(self, ctx: StageContext) -> Outputs:
        activation = self.lmd.activation
        original = activation.silu_and_mul

        @functools.wraps(original)
        def swapped(mm1: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            gate, up_ = mm1.chunk(2, dim=-1)
            return original(torch.cat([up_, gate], dim=-1), *args, **kwargs)

        with mock.patch.object(activation, "silu_and_mul", swapped):
            return super().act_quant(ctx)


class GatherWeightsReversed(LmdeployBackend):
    """gather: ep_gather reads each token's topk weights in reverse k order."""

    def gather(self, ctx: StageContext) -> Outputs:
        ep = self.lmd.ep
        original = ep.ep_gather

        @functools.wraps(original)
        def reversed_weights(mm2: Any, ids: Any, weights: torch.Tensor, *rest: Any) -> Any:
            return original(mm2, ids, weights.flip(1).contiguous(), *rest)

        with mock.patch.object(ep, "ep_gather", reversed_weights):
            return super().gather(ctx)


class GatherIgnoresWeights(LmdeployBackend):
    """gather: ep_gather sums each token's expert rows unweighted (every topk weight taken as 1)."""

    def gather(self, ctx: StageContext) -> Outputs:
        ep = self.lmd.ep
        original = ep.ep_gather

        @functools.wraps(original)
        def unweighted(mm2: Any, ids: Any, weights: torch.Tensor, *rest: Any) -> Any:
            return original(mm2, ids, torch.ones_like(weights), *rest)

        with mock.patch.object(ep, "ep_gather", unweighted):
            return super().gather(ctx)


WRONG_VARIANTS: tuple[type[LmdeployBackend], ...] = (
    QuantScalesFloored,
    QuantScaleFmtDropped,
    ScatterSlotToNeighbour,
    ActGateUpSwapped,
    GatherWeightsReversed,
    GatherIgnoresWeights,
)
