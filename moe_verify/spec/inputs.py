"""What a backend runs on: activations, routing logits, and the weights as the kernel sees them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """A stack of expert weights exactly as the kernel sees them (logical layout).

    q:      fp8 e4m3 [E, N, K], or uint8 [E, N, K/2] holding two E2M1 codes per byte
            (even element in the low nibble) when `fp4`.
    scale:  fp32 [E, N/128, K/128] for 128x128 blocks, or uint8 E8M0 bytes [E, N, K/32].
    block:  (rows, K elements) covered by one scale.
    """

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def fp4(self) -> bool:
        return self.q.dtype == torch.uint8

    @property
    def shape(self) -> tuple[int, int, int]:
        """Logical [E, N, K]."""
        e, n, k = self.q.shape
        return (e, n, 2 * k if self.fp4 else k)

    def select(self, experts: torch.Tensor | list[int]) -> QuantizedWeight:
        idx = torch.as_tensor(experts, dtype=torch.long, device=self.q.device)
        return QuantizedWeight(
            self.q.index_select(0, idx), self.scale.index_select(0, idx), self.block
        )


@dataclass(frozen=True)
class MoEInputs:
    """Everything a backend needs to run one problem; built by `moe_verify.make_inputs`.

    hidden_states   bf16 [T, H]
    router_logits   fp32 [T, E]
    score_bias      fp32 [E] (DeepSeek e_score_correction_bias) or None
    topk_ids        int32 [T, k] when the routing mode fixes ids directly, else None
    topk_weights    fp32 [T, k] alongside topk_ids, else None
    w13, w2         bf16 master weights [E, 2I, H] (gate rows first) and [E, H, I]
    w13_q, w2_q     the quantized, post-processed weights the kernel sees
    w13_ckpt, w2_ckpt  the checkpoint before UE8M0 requantization (None when no requant happened)
    shared_w13, shared_w2  the shared experts as one dense gated MLP [1, 2*Is, H], [1, H, Is]
                    (Is = intermediate x shared_experts), quantized like the routed experts
    """

    hidden_states: torch.Tensor
    router_logits: torch.Tensor
    score_bias: torch.Tensor | None
    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None
    w13: torch.Tensor
    w2: torch.Tensor
    w13_q: QuantizedWeight
    w2_q: QuantizedWeight
    w13_ckpt: QuantizedWeight | None = None
    w2_ckpt: QuantizedWeight | None = None
    shared_w13: QuantizedWeight | None = None
    shared_w2: QuantizedWeight | None = None

    def to(self, device: torch.device | str) -> MoEInputs:
        def mv(x: object) -> object:
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if isinstance(x, QuantizedWeight):
                return QuantizedWeight(x.q.to(device), x.scale.to(device), x.block)
            return x

        return MoEInputs(**{f.name: mv(getattr(self, f.name)) for f in dataclasses.fields(self)})
