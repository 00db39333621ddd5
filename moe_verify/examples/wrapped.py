"""A backend that wraps the optimized path instead of subclassing it.

The stage protocol asks for a `name` and one method per stage, `stage(ctx) -> outputs`; nothing
says how a class gets them. `StageDelegate` forwards every stage to an inner backend, so a kernel
developer who owns one stage writes that one and delegates the rest, whatever the inner class.

`HalvesOneToken` is the smallest such backend with a bug: its gather halves token 0's output row
(as a combine that applies one token's router weight twice to a top-2 pair would). Every command
takes it: `moe-verify run` and `moe-verify graph` fail it at gather, naming token 0, and
`moe-verify bench --production` times it. The class is not an `OptimizedBackend`.
"""

from __future__ import annotations

import torch

from moe_verify.spec import Engine, Outputs, StageContext, StageDelegate
from optimized import OptimizedBackend


class HalvesOneToken(StageDelegate):
    """The optimized path, with token 0's gathered row halved."""

    name = "halves-one-token"

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(OptimizedBackend(engine=engine), self.name)

    def gather(self, ctx: StageContext) -> Outputs:
        outputs = self.inner.gather(ctx)  # type: ignore[attr-defined]
        out = outputs["out"].clone()
        if out.shape[0]:
            out[0] = (out[0].float() / 2).to(torch.bfloat16)
        return {**outputs, "out": out}
