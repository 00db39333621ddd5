"""The stages of one rank's staged forward, how a tested backend's stages are fed, and verdicts.

docs/stage-contract.md gives each stage's outputs: names, shapes and dtypes.
"""

from __future__ import annotations

import enum

from moe_verify.spec.checks import _got


class Stage(enum.StrEnum):
    """Stage names of one rank's staged forward (docs/stage-contract.md), plus the cross-rank
    `reduce` that the topology runner makes from every rank's trace."""

    ROUTE = "route"
    QUANT_INPUT = "quant_input"
    ALIGN = "align"
    PERMUTE = "permute"
    DISPATCH = "dispatch"  # ep:N+ll: replaces align + permute by the batched layout
    GEMM1 = "gemm1"
    ACT_QUANT = "act_quant"
    GEMM2 = "gemm2"
    GATHER = "gather"
    SHARED = "shared"  # the shared experts' dense MLP, after the routed stages
    REDUCE = "reduce"


# One rank's stages in order: the contiguous layouts (m_indices, psum), and the masked one
# (GroupedLayout.MASKED: dispatch into per-expert batches; always under ep:N+ll).
STAGES: tuple[Stage, ...] = (
    Stage.ROUTE,
    Stage.QUANT_INPUT,
    Stage.ALIGN,
    Stage.PERMUTE,
    Stage.GEMM1,
    Stage.ACT_QUANT,
    Stage.GEMM2,
    Stage.GATHER,
)
BATCHED_STAGES: tuple[Stage, ...] = (
    Stage.ROUTE,
    Stage.QUANT_INPUT,
    Stage.DISPATCH,
    Stage.GEMM1,
    Stage.ACT_QUANT,
    Stage.GEMM2,
    Stage.GATHER,
)
# Every stage a report can hold, in report order (contiguous and batched layouts merged).
REPORT_STAGES: tuple[Stage, ...] = (
    Stage.ROUTE,
    Stage.QUANT_INPUT,
    Stage.ALIGN,
    Stage.PERMUTE,
    Stage.DISPATCH,
    Stage.GEMM1,
    Stage.ACT_QUANT,
    Stage.GEMM2,
    Stage.GATHER,
    Stage.SHARED,
    Stage.REDUCE,
)
# The two GEMM stages: the output each writes and the weight it multiplies by.
GEMM_OUTPUT: dict[Stage, str] = {Stage.GEMM1: "mm1", Stage.GEMM2: "mm2"}
GEMM_WEIGHT: dict[Stage, str] = {Stage.GEMM1: "w13", Stage.GEMM2: "w2"}


class Gemm1Columns(enum.StrEnum):
    """Which half of gemm1's `mm1` row holds the gate projection (DeepGEMM does not care; the
    activation that reads it does). A gemm1 that writes up-first, as a kernel whose w13 is
    `cat([w3, w1])` does, says so in its `column_order` entry, and its act_quant is then fed
    up-first rows (docs/stage-contract.md#gemm1-column-order)."""

    GATE_FIRST = "gate_first"  # [gate | up]: the suite's w13 and the default
    UP_FIRST = "up_first"  # [up | gate]


# gemm1's optional host entry naming its Gemm1Columns.
COLUMN_ORDER = "column_order"


class RouterWeight(enum.StrEnum):
    """Where a token's top-k router weight is applied (DeepGEMM does not care; the stages around
    it do): in the gather's weighted sum, or multiplied into the bf16 hidden states before
    quant_input, after which the gather sums with weight 1 (vLLM's and TensorRT-LLM's
    `apply_router_weight_on_input`, top-1 routing only). The problem says which
    (`MoEProblem.router_weight`), the golden follows it, and a quant_input may declare the one it
    applies in its `router_weight` entry (docs/stage-contract.md#router-weight)."""

    GATHER = "gather"  # the weighted sum over k: the default
    INPUT = "input"  # bf16(x * bf16(w)) quantized, the gather's weights all 1; topk == 1 only


# quant_input's optional host entry naming its RouterWeight; and the golden quant_input's map
# {other convention: {trace key: the same output's key in that convention}} (top-1 problems),
# from which the comparison names a quant_input that applies the weight where the problem does not.
ROUTER_WEIGHT = "router_weight"
ROUTER_WEIGHT_OUTPUTS = "router_weight_outputs"

# The `engine` entry a stage reports where an adapter ran the suite's own code in the engine's
# place (its router, DeepEP's count): the report's stage column then reads "align [suite]", so a
# pass there is not mistaken for the engine's.
SUITE_CODE = "suite"

# Each stage's per-slot outputs: [T, k], indexed like route's topk_ids, so a token's slot order
# runs through them.
PER_SLOT_OUTPUTS: dict[Stage, tuple[str, ...]] = {
    Stage.ROUTE: ("topk_ids", "topk_weights"),
    Stage.PERMUTE: ("inv_perm",),
    Stage.DISPATCH: ("slot", "slot_expert"),
}


class Mode(enum.StrEnum):
    """How the tested backend's stages are fed: each on the golden's upstream (isolated), or each on
    its own previous outputs (chained)."""

    ISOLATED = "isolated"  # each stage on the golden's upstream: a divergence is that stage's
    CHAINED = "chained"  # end to end on its own outputs: what a user gets

    @staticmethod
    def select(text: str | Mode) -> tuple[Mode, ...]:
        """'isolated', 'chained' or 'both' (isolated first: it names the culprit)."""
        if not isinstance(text, str):
            raise TypeError(f"mode: expected 'isolated', 'chained' or 'both', got {_got(text)}")
        if text == "both":
            return (Mode.ISOLATED, Mode.CHAINED)
        try:
            return (Mode(text),)
        except ValueError:
            raise ValueError(
                f"mode: expected 'isolated', 'chained' or 'both', got {text!r}"
            ) from None


MODE_CHOICES: tuple[str, ...] = (*(m.value for m in Mode), "both")

# The settings that must not change any promised output, so two runs that differ only in one
# agree bit for bit (tolerance/invariance.py INVARIANCES gives each its reason). `run
# --invariance` pairs each but the poison, which two `--poison` bytes pair.
INVARIANCE_KINDS: tuple[str, ...] = (
    "poison",
    "alignment",
    "m_sum",
    "ll_capacity",
    "expected_m",
    "num_sms",
)


class Status(enum.StrEnum):
    """Verdict of one compared stage (or one case)."""

    PASS = "pass"
    FAIL = "fail"  # a check failed
    SKIP = "skip"  # not compared here (the reason says why); never a pass
    ERROR = "error"  # a side raised, or the comparison could not run

    @property
    def failing(self) -> bool:
        return self in (Status.FAIL, Status.ERROR)


# The exit code of each verdict: 0 passed, 1 a check failed, 2 nothing trustworthy to say (an
# error, or every stage skipped).
EXIT_CODES = {Status.PASS: 0, Status.FAIL: 1, Status.ERROR: 2, Status.SKIP: 2}
