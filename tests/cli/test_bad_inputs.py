"""The bad-input catalogue (issue 12): every public function a user calls refuses what it cannot
run, with a ValueError or TypeError naming the argument and the value it got.

Each row is one bad input, its own test item (`-k topology-parse` picks a group). A row names the
exception type it expects and the strings its message must contain: the argument and the actual
value. A generic error (RuntimeError, AssertionError, IndexError, KeyError), a silent acceptance
or a message that does not say what was wrong fails the row. Rows build only tiny tensors and run
no kernel, so the whole catalogue takes about a second.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import moe_verify.run.inputs as inputs_mod
import reference
import tolerance
from moe_verify.run.inputs import make_inputs
from moe_verify.spec import (
    Activation,
    Mode,
    MoEInputs,
    MoEProblem,
    Placement,
    QuantizedWeight,
    Topology,
    TopologyKind,
    Trace,
)
from moe_verify.sweep import cases
from optimized import OptimizedBackend, deepgemm
from optimized.kernels import act_quant, gather, grouped_gemm, quant, scatter, slot_counts
from reference import formats, layout
from reference import gather as gather_ref
from reference import gemm as gemm_ref

pytestmark = pytest.mark.cpu

TINY = dict(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)
GROUPED = dict(routing="grouped", num_experts=8, num_expert_group=4, topk_group=2)
# Errors that say nothing about the input: never an acceptable answer to a bad argument.
GENERIC = (RuntimeError, AssertionError, IndexError, KeyError, AttributeError)


def tiny(**changes: object) -> MoEProblem:
    return MoEProblem(**{**TINY, **changes})


@dataclass(frozen=True)
class Bad:
    """One bad input: `call` must raise `exc` with every string of `needles` in its message."""

    id: str
    call: Callable[[], object]
    exc: type[Exception]
    needles: tuple[str, ...]


def bad(id: str, call: Callable[[], object], exc: type[Exception], *needles: str) -> Bad:
    return Bad(id, call, exc, needles)


def _problem_field_rows() -> list[Bad]:
    """Every int field of MoEProblem: wrong types (TypeError) and out-of-range values."""
    rows = []
    wrong_types = {"float": 64.5, "bool": True, "none": None, "str": "4", "tensor": torch.tensor(4)}
    out_of_range = {
        "tokens": (0, -1, 2_000_000),  # 0: an empty problem would pass, verifying nothing
        "hidden": (0, -128, 1 << 17),
        "intermediate": (0, -128, 1 << 17),
        "num_experts": (0, -4, 5000),
        "topk": (0, -1, 5),
        "seed": (-1, 1 << 64),
        "alignment": (0, 3, -128, 2048, 12, 1),
        "num_expert_group": (0, -1, 9),
        "topk_group": (0, 5),
        "shared_experts": (-1, 65),
    }
    for name, values in out_of_range.items():
        base = GROUPED if name in ("num_expert_group", "topk_group") else {}
        for kind, value in wrong_types.items():
            rows.append(
                bad(
                    f"MoEProblem-{name}-{kind}",
                    lambda n=name, v=value, b=base: tiny(**{**b, n: v}),
                    TypeError,
                    f"MoEProblem.{name}",
                    repr(value),
                )
            )
        for value in values:
            rows.append(
                bad(
                    f"MoEProblem-{name}-{value}",
                    lambda n=name, v=value, b=base: tiny(**{**b, n: v}),
                    ValueError,
                    f"MoEProblem.{name}",
                    str(value),
                )
            )
    return rows


def _problem_rows() -> list[Bad]:
    nan, inf = math.nan, math.inf
    rows = [
        # floats and bools
        *(
            bad(
                f"MoEProblem-routed_scaling_factor-{v}",
                lambda v=v: tiny(**GROUPED, routed_scaling_factor=v),
                ValueError,
                "routed_scaling_factor",
                repr(v),
            )
            for v in (nan, inf, -inf, 0.0, -2.5)
        ),
        *(
            bad(
                f"MoEProblem-routed_scaling_factor-{type(v).__name__}",
                lambda v=v: tiny(**GROUPED, routed_scaling_factor=v),
                TypeError,
                "routed_scaling_factor",
                repr(v),
            )
            for v in (True, "2.5", None)
        ),
        *(
            bad(
                f"MoEProblem-{name}-{value!r}",
                lambda n=name, v=value: tiny(**{n: v}),
                TypeError,
                f"MoEProblem.{name}",
                repr(value),
            )
            for name in ("provenance", "renormalize")
            for value in (1, 0, "no", "yes", None, 1.0)
        ),
        # routing parameters a routing mode would ignore
        bad(
            "MoEProblem-routed_scaling_factor-ignored-by-softmax",
            lambda: tiny(routed_scaling_factor=2.5),
            ValueError,
            "routed_scaling_factor",
            "2.5",
            "softmax",
        ),
        bad(
            "MoEProblem-routed_scaling_factor-ignored-by-uniform",
            lambda: tiny(routing="uniform", routed_scaling_factor=0.5),
            ValueError,
            "routed_scaling_factor",
            "0.5",
        ),
        bad(
            "MoEProblem-topk_group-gt-num_expert_group",
            lambda: tiny(routing="skew", topk_group=2),
            ValueError,
            "topk_group",
            "2",
        ),
        *(
            bad(
                f"MoEProblem-renormalize-False-ignored-by-{r}",
                lambda r=r: tiny(routing=r, renormalize=False),
                ValueError,
                "renormalize",
                "False",
                r,
            )
            for r in ("uniform", "one_expert", "invalid_slots", "duplicates")
        ),
        # enums given as strings
        *(
            bad(
                f"MoEProblem-{name}-{value!r}",
                lambda n=name, v=value: tiny(**{n: v}),
                ValueError,
                f"MoEProblem.{name}",
                repr(value),
            )
            for name, value in (
                ("recipe", "fp8"),
                ("recipe", "FP8_BLOCK"),
                ("recipe", ""),
                ("scale_fmt", "fp32"),
                ("scale_fmt", "ue8m0"),
                ("routing", "topk"),
                ("routing", "Softmax"),
                ("grouped_layout", "psums"),
            )
        ),
        *(
            bad(
                f"MoEProblem-{name}-{type(value).__name__}",
                lambda n=name, v=value: tiny(**{n: v}),
                TypeError,
                f"MoEProblem.{name}",
                repr(value),
            )
            for name, value in (
                ("recipe", 3),
                ("recipe", None),
                ("scale_fmt", None),
                ("routing", 1),
                ("grouped_layout", True),
                ("topology", 4),
                ("topology", None),
                ("activation", 3),
                ("activation", ["silu"]),
            )
        ),
        bad("MoEProblem-activation-gelu", lambda: tiny(activation="gelu"), ValueError, "'gelu'"),
        bad("MoEProblem-topology-tp2", lambda: tiny(topology="tp2"), ValueError, "'tp2'"),
        bad(
            "MoEProblem-topology-ep100000",
            lambda: tiny(topology="ep:100000"),
            ValueError,
            "'ep:100000'",
            "100000",
        ),
        # mismatched combinations
        bad("MoEProblem-topk-gt-E", lambda: tiny(topk=8), ValueError, "topk", "8"),
        bad(
            "MoEProblem-scale_fmt-not-for-mxfp8",
            lambda: tiny(recipe="mxfp8", scale_fmt="float32"),
            ValueError,
            "scale_fmt",
            "float32",
        ),
        bad(
            "MoEProblem-scale_fmt-not-for-mxfp4",
            lambda: tiny(recipe="mxfp4_w4a8", scale_fmt="float32"),
            ValueError,
            "scale_fmt",
            "float32",
        ),
        bad("MoEProblem-hidden-not-x128", lambda: tiny(hidden=192), ValueError, "hidden", "192"),
        bad(
            "MoEProblem-hidden-not-x32-mxfp8",
            lambda: tiny(hidden=80, recipe="mxfp8", scale_fmt="ue8m0_packed"),
            ValueError,
            "hidden",
            "80",
        ),
        bad(
            "MoEProblem-intermediate-not-x128",
            lambda: tiny(intermediate=192),
            ValueError,
            "intermediate",
            "192",
        ),
        bad(
            "MoEProblem-intermediate-not-splitting-over-tp3",
            lambda: tiny(intermediate=512, topology="tp:3"),
            ValueError,
            "intermediate",
            "512",
            "tp=3",
        ),
        bad(
            "MoEProblem-intermediate-per-rank-not-x128-tp4",
            lambda: tiny(intermediate=256, topology="tp:4"),
            ValueError,
            "intermediate",
            "256",
        ),
        bad(
            "MoEProblem-empty-routing-topk-eq-E",
            lambda: tiny(routing="empty_middle", topk=4),
            ValueError,
            "topk",
            "4",
            "empty_middle",
        ),
        bad(
            "MoEProblem-grouped-E-not-divisible",
            lambda: tiny(**{**GROUPED, "num_expert_group": 3, "topk_group": 1}),
            ValueError,
            "num_expert_group",
            "3",
        ),
        bad(
            "MoEProblem-grouped-topk_group-gt-groups",
            lambda: tiny(**{**GROUPED, "num_expert_group": 2, "topk_group": 3}),
            ValueError,
            "topk_group",
            "3",
        ),
        bad(
            "MoEProblem-grouped-topk-gt-kept-experts",
            lambda: tiny(**{**GROUPED, "topk_group": 1, "topk": 3}),
            ValueError,
            "topk",
            "3",
        ),
        bad(
            "MoEProblem-shared-not-sharding-over-ep4",
            lambda: tiny(shared_experts=1, topology="ep:4"),
            ValueError,
            "shared_experts",
            "1",
        ),
        bad(
            "MoEProblem-shared-not-sharding-over-ep3",
            lambda: tiny(shared_experts=2, topology="ep:3"),
            ValueError,
            "shared_experts",
            "256",
        ),
        bad(
            "MoEProblem-ep-ll-mxfp8",
            lambda: tiny(recipe="mxfp8", scale_fmt="ue8m0_packed", topology="ep:2+ll"),
            ValueError,
            "ep+ll",
            "mxfp8",
        ),
        bad(
            "MoEProblem-ep-ll-packed",
            lambda: tiny(scale_fmt="ue8m0_packed", topology="ep:2+ll"),
            ValueError,
            "ep+ll",
            "ue8m0_packed",
        ),
        bad(
            "MoEProblem-ep-ll-swigluoai",
            lambda: tiny(activation="swigluoai", topology="ep:2+ll"),
            ValueError,
            "ep+ll",
            "swigluoai",
        ),
        bad(
            "MoEProblem-explicit-missing-expert",
            lambda: tiny(topology=Topology.explicit_ep([[0, 1], [1, 2]])),
            ValueError,
            "explicit",
            "missing [3]",
        ),
        bad(
            "MoEProblem-explicit-expert-beyond-E",
            lambda: tiny(topology=Topology.explicit_ep([[0, 1], [2, 3, 7]])),
            ValueError,
            "explicit",
            "[7]",
        ),
    ]
    return rows


def _topology_rows() -> list[Bad]:
    e, p = TopologyKind, Placement
    rows = [
        bad("Topology-kind-TP", lambda: Topology("TP", 2), ValueError, "Topology.kind", "'TP'"),
        bad("Topology-kind-pp", lambda: Topology("pp", 2), ValueError, "Topology.kind", "'pp'"),
        bad("Topology-kind-int", lambda: Topology(1, 2), TypeError, "Topology.kind", "1"),
        bad("Topology-kind-none", lambda: Topology(None, 2), TypeError, "Topology.kind", "None"),
        bad(
            "Topology-placement-rr",
            lambda: Topology(e.EP, 2, "rr"),
            ValueError,
            "Topology.placement",
            "'rr'",
        ),
        bad(
            "Topology-placement-int",
            lambda: Topology(e.EP, 2, 3),
            TypeError,
            "Topology.placement",
            "3",
        ),
        bad(
            "Topology-tp-round-robin",
            lambda: Topology(e.TP, 2, p.ROUND_ROBIN),
            ValueError,
            "placement",
            "round_robin",
        ),
        bad(
            "Topology-explicit-without-list",
            lambda: Topology(e.EP, 2, p.EXPLICIT),
            ValueError,
            "explicit",
            "None",
        ),
        bad(
            "Topology-list-without-explicit",
            lambda: Topology(e.EP, 2, p.LINEAR, ((0,), (1,))),
            ValueError,
            "explicit",
            "linear",
        ),
        bad(
            "Topology-explicit-rank-count",
            lambda: Topology(e.EP, 3, p.EXPLICIT, ((0,), (1,))),
            ValueError,
            "Topology.explicit",
            "2 lists",
        ),
        bad(
            "Topology-ep-ht-round-robin",
            lambda: Topology(e.EP_HT, 2, p.ROUND_ROBIN),
            ValueError,
            "placement",
            "round_robin",
        ),
        bad(
            "Topology-explicit-not-a-list",
            lambda: Topology(e.EP, 1, p.EXPLICIT, 5),
            TypeError,
            "Topology.explicit",
            "5",
        ),
    ]
    for value in (0, -1, 65, 100000):
        rows.append(
            bad(
                f"Topology-size-{value}",
                lambda v=value: Topology(e.EP, v),
                ValueError,
                "Topology.size",
                str(value),
            )
        )
    for value in (2.0, True, "2", None):
        rows.append(
            bad(
                f"Topology-size-{type(value).__name__}",
                lambda v=value: Topology(e.EP, v),
                TypeError,
                "Topology.size",
                repr(value),
            )
        )
    for name, ranks, exc, needle in (
        ("empty", [], ValueError, "got 0"),
        ("65-ranks", [[0]] * 65, ValueError, "65"),
        ("string", "0123", TypeError, "'0123'"),
        ("rank-string", ["01", "23"], TypeError, "'01'"),
        ("float-id", [[0, 1.5]], TypeError, "1.5"),
        ("bool-id", [[True]], TypeError, "True"),
        ("negative-id", [[0, -1]], ValueError, "-1"),
        ("int", 5, TypeError, "5"),
    ):
        rows.append(
            bad(
                f"Topology.explicit_ep-{name}",
                lambda r=ranks: Topology.explicit_ep(r),
                exc,
                "Topology.explicit",
                needle,
            )
        )
    for text in (
        "ep:100000",
        "ep:0",
        "tp:0",
        "ep:65",
        "tp:-1",
        "ep",
        "ep:",
        "ep:two",
        "tp:2+ll",
        "tp:2:round_robin",
        "ep:2:explicit",
        "ep:2+xx",
        "EP:2",
        "",
        "ep:2.5",
        "ep:1e3",
        "tp 2",
    ):
        rows.append(
            bad(
                f"Topology.parse-{text or 'empty'}",
                lambda t=text: Topology.parse(t),
                ValueError,
                "topology",
                repr(text),
            )
        )
    for value in (None, 2, ["ep:2"]):
        rows.append(
            bad(
                f"Topology.parse-{type(value).__name__}",
                lambda v=value: Topology.parse(v),
                TypeError,
                "topology",
                repr(value),
            )
        )
    return rows


def _activation_rows() -> list[Bad]:
    nan, inf = math.nan, math.inf
    rows = [
        bad("Activation-kind-gelu", lambda: Activation("gelu"), ValueError, "kind", "'gelu'"),
        bad("Activation-kind-SILU", lambda: Activation("SILU"), ValueError, "kind", "'SILU'"),
        bad("Activation-kind-int", lambda: Activation(3), TypeError, "kind", "3"),
        bad("Activation-kind-none", lambda: Activation(None), TypeError, "kind", "None"),
        bad(
            "Activation-silu-alpha",
            lambda: Activation("silu", alpha=2.0),
            ValueError,
            "alpha",
            "2.0",
        ),
        bad("Activation-silu-beta", lambda: Activation("silu", beta=1.0), ValueError, "beta"),
    ]
    for field, values in (("alpha", (nan, inf, -inf)), ("beta", (nan, inf))):
        for v in values:
            rows.append(
                bad(
                    f"Activation-{field}-{v}",
                    lambda f=field, v=v: Activation("swigluoai", **{f: v}),
                    ValueError,
                    f"Activation.{field}",
                    repr(v),
                )
            )
        for v in ("1", True, None):
            rows.append(
                bad(
                    f"Activation-{field}-{type(v).__name__}",
                    lambda f=field, v=v: Activation("swigluoai", **{f: v}),
                    TypeError,
                    f"Activation.{field}",
                    repr(v),
                )
            )
    for v in (0.0, -1.0, nan, inf):
        rows.append(
            bad(
                f"Activation-limit-{v}",
                lambda v=v: Activation("silu", limit=v),
                ValueError,
                "Activation.limit",
                repr(v),
            )
        )
    for v in ("7", True):
        rows.append(
            bad(
                f"Activation-limit-{type(v).__name__}",
                lambda v=v: Activation("silu", limit=v),
                TypeError,
                "Activation.limit",
                repr(v),
            )
        )
    for text, needle in (
        ("gelu", "'gelu'"),
        ("silu:7", "'silu:7'"),
        ("silu:L", "limit"),
        ("silu:Lx", "'x'"),
        ("silu:L7:L8", "'silu:L7:L8'"),
        ("silu:L0", "0.0"),
        ("silu:L-1", "-1.0"),
        ("silu:Lnan", "nan"),
        ("swigluoai:x", "'x'"),
        ("swigluoai:1:2:3:4", "4 values"),
        ("swigluoai:1:2:0", "0.0"),
        ("swigluoai:1:2:nan", "nan"),
        ("swigluoai:inf", "inf"),
        ("", "''"),
        (":", "':'"),
    ):
        rows.append(
            bad(
                f"Activation.parse-{text or 'empty'}",
                lambda t=text: Activation.parse(t),
                ValueError,
                "activation" if needle.startswith("'") else needle,
                needle,
            )
        )
    for value in (None, 3):
        rows.append(
            bad(
                f"Activation.parse-{type(value).__name__}",
                lambda v=value: Activation.parse(v),
                TypeError,
                "activation",
                repr(value),
            )
        )
    return rows


def _with(d: dict[str, object], path: tuple[str, ...], value: object) -> dict[str, object]:
    """A copy of the problem dict `d` with `path` set to `value` (or removed when `value` is
    `_DROP`)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DROP = object()


def _from_dict_rows() -> list[Bad]:
    d = tiny().to_dict()
    rows = []
    for name, path, value, exc, needles in (
        ("unknown-key", ("tokns",), 4, ValueError, ("tokns",)),
        ("missing-tokens", ("tokens",), _DROP, ValueError, ("tokens", "missing")),
        ("missing-seed", ("seed",), _DROP, ValueError, ("seed", "missing")),
        ("topology-missing-size", ("topology", "size"), _DROP, ValueError, ("size", "topology")),
        ("topology-unknown-key", ("topology", "ranks"), 2, ValueError, ("ranks", "topology")),
        ("activation-unknown-key", ("activation", "gamma"), 1.0, ValueError, ("gamma",)),
        ("activation-missing-limit", ("activation", "limit"), _DROP, ValueError, ("limit",)),
        ("topology-int", ("topology",), 5, TypeError, ("topology", "5")),
        ("activation-list", ("activation",), ["silu"], TypeError, ("activation", "['silu']")),
        ("tokens-string", ("tokens",), "64", TypeError, ("MoEProblem.tokens", "'64'")),
        ("tokens-float", ("tokens",), 64.5, TypeError, ("MoEProblem.tokens", "64.5")),
        ("topology-kind", ("topology", "kind"), "tpx", ValueError, ("Topology.kind", "'tpx'")),
        ("topology-size-string", ("topology", "size"), "2", TypeError, ("Topology.size", "'2'")),
        ("topology-size-huge", ("topology", "size"), 100000, ValueError, ("Topology.size",)),
        ("activation-alpha", ("activation", "alpha"), "x", TypeError, ("alpha", "'x'")),
        ("recipe", ("recipe",), "fp9", ValueError, ("MoEProblem.recipe", "'fp9'")),
        ("provenance-string", ("provenance",), "false", TypeError, ("provenance", "'false'")),
    ):
        rows.append(
            bad(
                f"MoEProblem.from_dict-{name}",
                lambda p=path, v=value: MoEProblem.from_dict(_with(d, p, v)),
                exc,
                *needles,
            )
        )
    rows.append(
        bad(
            "MoEProblem.from_dict-explicit-float",
            lambda: MoEProblem.from_dict(
                _with(
                    tiny(topology=Topology.explicit_ep([[0, 1], [2, 3]])).to_dict(),
                    ("topology", "explicit"),
                    [[0, 1], [2, 3.0]],
                )
            ),
            TypeError,
            "Topology.explicit[1][1]",
            "3.0",
        )
    )
    rows.append(
        bad("MoEProblem.from_dict-list", lambda: MoEProblem.from_dict([1]), TypeError, "[1]")
    )
    return rows


@functools.cache
def _inputs_of(problem: MoEProblem) -> MoEInputs:
    """make_inputs once per problem (rows only read them, or replace fields of a copy)."""
    return make_inputs(problem, "cpu")


def _replace_inputs(problem: MoEProblem, **changes: object) -> MoEInputs:
    return dataclasses.replace(_inputs_of(problem), **changes)


def _check(problem: MoEProblem, x: MoEInputs) -> None:
    inputs_mod.check_inputs(problem, x)


def _check_inputs_rows() -> list[Bad]:
    p = tiny()
    uniform = tiny(routing="uniform")
    return [
        bad(
            "check_inputs-E4-inputs-for-E8",
            lambda: _check(p.replace(num_experts=8), _inputs_of(p)),
            ValueError,
            "inputs.",
            "[4, 4]",
            "E8",
        ),
        bad(
            "check_inputs-T4-inputs-for-T8",
            lambda: _check(p.replace(tokens=8), _inputs_of(p)),
            ValueError,
            "inputs.hidden_states",
            "[4, 128]",
            "T8",
        ),
        bad(
            "check_inputs-H128-inputs-for-H256",
            lambda: _check(p.replace(hidden=256), _inputs_of(p)),
            ValueError,
            "inputs.hidden_states",
            "[4, 128]",
        ),
        bad(
            "check_inputs-I128-inputs-for-I256",
            lambda: _check(p.replace(intermediate=256), _inputs_of(p)),
            ValueError,
            "inputs.w13",
            "[4, 256, 128]",
        ),
        bad(
            "check_inputs-fp8-inputs-for-mxfp8",
            lambda: _check(p.replace(recipe="mxfp8", scale_fmt="ue8m0_packed"), _inputs_of(p)),
            ValueError,
            "inputs.w13_q",
            "(128, 128)",
        ),
        bad(
            "check_inputs-shared-missing",
            lambda: _check(p.replace(shared_experts=1), _inputs_of(p)),
            ValueError,
            "inputs.shared_w13",
            "None",
        ),
        bad(
            "check_inputs-shared-unexpected",
            lambda: _check(p, _inputs_of(p.replace(shared_experts=1))),
            ValueError,
            "inputs.shared_w13",
            "QuantizedWeight",
        ),
        bad(
            "check_inputs-bias-without-grouped",
            lambda: _check(p, _replace_inputs(p, score_bias=torch.zeros(4))),
            ValueError,
            "inputs.score_bias",
            "[4]",
        ),
        bad(
            "check_inputs-bias-wrong-shape",
            lambda: _check(
                tiny(**GROUPED),
                _replace_inputs(tiny(**GROUPED), score_bias=torch.zeros(4)),
            ),
            ValueError,
            "inputs.score_bias",
            "[4]",
        ),
        bad(
            "check_inputs-ids-missing-for-uniform",
            lambda: _check(uniform, _replace_inputs(uniform, topk_ids=None, topk_weights=None)),
            ValueError,
            "inputs.topk_ids",
            "None",
        ),
        bad(
            "check_inputs-ids-without-weights",
            lambda: _check(uniform, _replace_inputs(uniform, topk_weights=None)),
            ValueError,
            "topk_weights",
            "None",
        ),
        bad(
            "check_inputs-ids-out-of-range",
            lambda: _check(
                uniform,
                _replace_inputs(uniform, topk_ids=torch.full((4, 2), 9, dtype=torch.int32)),
            ),
            ValueError,
            "inputs.topk_ids",
            "9",
        ),
        bad(
            "check_inputs-ids-float",
            lambda: _check(uniform, _replace_inputs(uniform, topk_ids=torch.zeros(4, 2))),
            ValueError,
            "inputs.topk_ids",
            "torch.float32",
        ),
        bad(
            "check_inputs-hidden-fp32",
            lambda: _check(p, _replace_inputs(p, hidden_states=torch.zeros(4, 128))),
            ValueError,
            "inputs.hidden_states",
            "torch.float32",
        ),
        bad(
            "check_inputs-logits-other-device",
            lambda: _check(p, _replace_inputs(p, router_logits=torch.zeros(4, 4, device="meta"))),
            ValueError,
            "inputs.router_logits",
            "meta",
        ),
        bad(
            "check_inputs-weight-not-quantized",
            lambda: _check(p, _replace_inputs(p, w2_q=torch.zeros(4, 128, 128))),
            ValueError,
            "inputs.w2_q",
            "a tensor",
        ),
        bad(
            "check_inputs-ckpt-without-requant",
            lambda: _check(p, _replace_inputs(p, w13_ckpt=_inputs_of(p).w13_q)),
            ValueError,
            "inputs.w13_ckpt",
            "QuantizedWeight",
        ),
        bad(
            "check_inputs-scale-wrong-shape",
            lambda: _check(
                p,
                _replace_inputs(
                    p,
                    w2_q=QuantizedWeight(_inputs_of(p).w2_q.q, torch.ones(4, 2, 2), (128, 128)),
                ),
            ),
            ValueError,
            "inputs.w2_q.scale",
            "[4, 2, 2]",
        ),
        bad(
            "check_inputs-not-inputs",
            lambda: _check(p, {"hidden_states": None}),
            TypeError,
            "inputs",
            "dict",
        ),
        bad(
            "check_inputs-not-problem",
            lambda: _check("fp8_block", _inputs_of(p)),
            TypeError,
            "problem",
            "str",
        ),
        bad("make_inputs-not-problem", lambda: make_inputs("tiny", "cpu"), TypeError, "str"),
        bad("make_inputs-device-gpu", lambda: make_inputs(p, "gpu"), ValueError, "'gpu'"),
        bad("make_inputs-device-int", lambda: make_inputs(p, 1.5), TypeError, "1.5"),
    ]


def _m_sum_rows() -> list[Bad]:
    rows = []
    counts = torch.tensor([1, 2], dtype=torch.int32)
    for mod, name in ((layout, "reference"), (slot_counts, "optimized")):
        bounds = (
            ("upper_bound", mod.aligned_m_sum_upper_bound),
            ("all_experts_bound", getattr(mod, "aligned_m_sum_all_experts_bound", None)),
        )
        for fn_name, fn in bounds:
            if fn is None:
                continue
            for arg, index, value, exc in (
                ("num_tokens", 0, -1, ValueError),
                ("topk", 1, -2, ValueError),
                ("num_local_experts", 2, -4, ValueError),
                ("alignment", 3, 0, ValueError),
                ("alignment", 3, -128, ValueError),
                ("num_tokens", 0, 4.5, TypeError),
                ("topk", 1, True, TypeError),
                ("alignment", 3, None, TypeError),
            ):
                args = [4, 2, 4, 128]
                args[index] = value
                rows.append(
                    bad(
                        f"{name}.aligned_m_sum_{fn_name}-{arg}-{value!r}",
                        lambda f=fn, a=tuple(args): f(*a),
                        exc,
                        arg,
                        repr(value),
                    )
                )
        for label, c, a, exc, needles in (
            ("counts-negative", torch.tensor([3, -5]), 128, ValueError, ("counts", "-5")),
            ("counts-float", torch.tensor([1.5, 2.0]), 128, ValueError, ("counts", "float")),
            ("alignment-0", counts, 0, ValueError, ("alignment", "0")),
            ("alignment-float", counts, 128.0, TypeError, ("alignment", "128.0")),
        ):
            rows.append(
                bad(
                    f"{name}.aligned_m_sum_exact-{label}",
                    lambda m=mod, c=c, a=a: m.aligned_m_sum_exact(c, a),
                    exc,
                    *needles,
                )
            )
    rows += [
        bad(
            "reference.aligned_m_sum_exact-counts-list",
            lambda: layout.aligned_m_sum_exact([1, 2], 128),
            TypeError,
            "counts",
            "list",
        ),
        bad(
            "reference.aligned_m_sum_exact-counts-2d",
            lambda: layout.aligned_m_sum_exact(torch.ones(2, 2, dtype=torch.int32), 128),
            ValueError,
            "counts",
            "[2, 2]",
        ),
        bad(
            "reference.aligned_m_sum_recipes-counts-negative",
            lambda: layout.aligned_m_sum_recipes(4, 2, torch.tensor([-1, 9]), 128),
            ValueError,
            "counts",
            "-1",
        ),
        bad(
            "optimized.aligned_m_sum_exact-counts-bool",
            lambda: slot_counts.aligned_m_sum_exact([True, 2], 128),
            TypeError,
            "counts[0]",
            "True",
        ),
    ]
    return rows


def _kernel_rows() -> list[Bad]:
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    rows = []
    for fn_name, fn in (
        ("quantize_fp8_groups", quant.quantize_fp8_groups),
        ("quantize_fp8_groups_packed", quant.quantize_fp8_groups_packed),
    ):
        for value in (0.0, -1e-10, math.nan, math.inf):
            rows.append(
                bad(
                    f"kernels.{fn_name}-eps-{value}",
                    lambda f=fn, v=value: f(x, eps=v),
                    ValueError,
                    "eps",
                    repr(value),
                )
            )
        for value in (True, "1e-10", None):
            rows.append(
                bad(
                    f"kernels.{fn_name}-eps-{type(value).__name__}",
                    lambda f=fn, v=value: f(x, eps=v),
                    TypeError,
                    "eps",
                    repr(value),
                )
            )
    for arg, value, exc in (
        ("scale_fmt", "fp32", ValueError),
        ("scale_fmt", 3, TypeError),
        ("column_major", "no", TypeError),
        ("column_major", 1, TypeError),
        ("tma_aligned", "yes", TypeError),
    ):
        rows.append(
            bad(
                f"kernels.quantize_fp8_groups-{arg}-{value!r}",
                lambda a=arg, v=value: quant.quantize_fp8_groups(x, **{a: v}),
                exc,
                arg,
                repr(value),
            )
        )
    rows.append(
        bad(
            "kernels.quantize_fp8_groups-group-bool",
            lambda: quant.quantize_fp8_groups(x, group=True),
            ValueError,
            "group",
            "True",
        )
    )
    rows.append(
        bad(
            "kernels.pack_ue8m0_from_fp32-validate-no",
            lambda: quant.pack_ue8m0_from_fp32(torch.ones(4, 4), validate="no"),
            TypeError,
            "validate",
            "'no'",
        )
    )
    mm1 = torch.zeros(4, 256, dtype=torch.bfloat16)
    silu = Activation()
    for arg, value, exc in (
        ("scale_fmt", "packed", ValueError),
        ("scale_fmt", None, TypeError),
        ("validate", "no", TypeError),
        ("validate", 0, TypeError),
    ):
        rows.append(
            bad(
                f"kernels.silu_mul_quant-{arg}-{value!r}",
                lambda a=arg, v=value: act_quant.silu_mul_quant(
                    mm1, silu, 128, **{"scale_fmt": "float32", a: v}
                ),
                exc,
                arg,
                repr(value),
            )
        )
    rows.append(
        bad(
            "kernels.silu_mul_quant-activation-string",
            lambda: act_quant.silu_mul_quant(mm1, "silu", 128, "float32"),
            ValueError,
            "activation",
            "str",
        )
    )
    dummy = torch.zeros(1)
    for arg, value in (("use_psum_layout", "no"), ("validate", 1)):
        rows.append(
            bad(
                f"kernels.grouped_gemm-{arg}-{value!r}",
                lambda a=arg, v=value: grouped_gemm.grouped_gemm(
                    dummy, dummy, 128, dummy, dummy, (128, 128), dummy, 128, **{a: v}
                ),
                TypeError,
                arg,
                repr(value),
            )
        )
    rows += [
        bad(
            "kernels.ep_gather-validate-no",
            lambda: gather.ep_gather(dummy, dummy, dummy, dummy, validate="no"),
            TypeError,
            "validate",
            "'no'",
        ),
        bad(
            "kernels.count_expert_tokens-validate-no",
            lambda: slot_counts.count_expert_tokens(dummy, 4, validate="no"),
            TypeError,
            "validate",
            "'no'",
        ),
        bad(
            "kernels.ep_scatter-validate-none",
            lambda: scatter.ep_scatter(dummy, dummy, dummy, dummy, 4, 128, 128, validate=None),
            TypeError,
            "validate",
            "None",
        ),
    ]
    return rows


def _reference_quant_rows() -> list[Bad]:
    w = torch.zeros(128, 128)
    rows = [
        bad(
            f"reference.quantize_fp8_blocks-use_ue8m0-{value!r}",
            lambda v=value: formats.quantize_fp8_blocks(w, (128, 128), use_ue8m0=v),
            TypeError,
            "use_ue8m0",
            repr(value),
        )
        for value in ("no", 1, None, "False")
    ]
    rows += [
        bad(
            f"reference.quantize_fp8_groups-eps-{value!r}",
            lambda v=value: formats.quantize_fp8_groups(w, eps=v),
            ValueError,
            "eps",
            repr(value),
        )
        for value in (True, 0.0, -1.0, math.nan, math.inf)
    ]
    rows += [
        bad(
            "reference.quantize_fp8_groups-group-0",
            lambda: formats.quantize_fp8_groups(w, group=0),
            ValueError,
            "group",
            "0",
        ),
        bad(
            "reference.quantize_fp8_groups-scale_fmt",
            lambda: formats.quantize_fp8_groups(w, scale_fmt="fp32"),
            ValueError,
            "scale_fmt",
            "'fp32'",
        ),
    ]
    return rows


def _deepgemm_rows() -> list[Bad]:
    a = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    w = QuantizedWeight(
        torch.zeros(1, 128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, 1), (128, 128)
    )
    layout_ = torch.zeros(128, dtype=torch.int32)
    scale = torch.ones(128, 1)
    rows = []
    for value in ("no", 1, None):
        rows += [
            bad(
                f"deepgemm.validate_contiguous_call-use_ue8m0-{value!r}",
                lambda v=value: deepgemm.validate_contiguous_call(a, scale, w, layout_, 128, v),
                TypeError,
                "use_ue8m0",
                repr(value),
            ),
            bad(
                f"deepgemm.m_grouped_gemm-use_ue8m0-{value!r}",
                lambda v=value: deepgemm.m_grouped_gemm(
                    a, scale, 128, w, scale, layout_, 128, use_ue8m0=v
                ),
                TypeError,
                "use_ue8m0",
                repr(value),
            ),
            bad(
                f"deepgemm.m_grouped_gemm_masked-use_ue8m0-{value!r}",
                lambda v=value: deepgemm.m_grouped_gemm_masked(
                    a, scale, w, scale, layout_, 128, use_ue8m0=v
                ),
                TypeError,
                "use_ue8m0",
                repr(value),
            ),
            bad(
                f"deepgemm.prepare_weight_scales-use_ue8m0-{value!r}",
                lambda v=value: deepgemm.prepare_weight_scales(w, v),
                TypeError,
                "use_ue8m0",
                repr(value),
            ),
        ]
    rows.append(
        bad(
            "deepgemm.m_grouped_gemm-use_psum_layout-yes",
            lambda: deepgemm.m_grouped_gemm(
                a, scale, 128, w, scale, layout_, 128, use_ue8m0=False, use_psum_layout="yes"
            ),
            TypeError,
            "use_psum_layout",
            "'yes'",
        )
    )
    return rows


def _preflight(problem: object, device: object) -> None:
    from moe_verify.run.preflight import preflight

    preflight(problem, device)


# Far beyond any machine's memory, yet within MoEProblem's bounds (DeepSeek-V3's layer shape).
HUGE = MoEProblem(tokens=1_000_000, hidden=7168, intermediate=2048, num_experts=256, topk=8)


def _misc_rows() -> list[Bad]:
    return [
        bad(
            "preflight-huge-problem-cpu",
            lambda: _preflight(HUGE, "cpu"),
            ValueError,
            "T1000000",
            "largest tensor",
            "GiB",
            "free",
        ),
        bad("preflight-not-problem", lambda: _preflight({"tokens": 4}, "cpu"), TypeError, "dict"),
        bad("preflight-device-int", lambda: _preflight(tiny(), 3.5), TypeError, "3.5"),
        bad("preset-unknown", lambda: cases.preset("smoke2"), ValueError, "preset", "'smoke2'"),
        bad("preset-case", lambda: cases.preset("SMOKE"), ValueError, "preset", "'SMOKE'"),
        bad("preset-empty", lambda: cases.preset(""), ValueError, "preset", "''"),
        bad("preset-none", lambda: cases.preset(None), ValueError, "preset", "None"),
        bad("preset-list", lambda: cases.preset(["smoke"]), ValueError, "preset", "['smoke']"),
        bad("Mode.select-iso", lambda: Mode.select("iso"), ValueError, "mode", "'iso'"),
        bad("Mode.select-BOTH", lambda: Mode.select("BOTH"), ValueError, "mode", "'BOTH'"),
        bad("Mode.select-empty", lambda: Mode.select(""), ValueError, "mode", "''"),
        bad("Mode.select-none", lambda: Mode.select(None), TypeError, "mode", "None"),
        bad("Mode.select-int", lambda: Mode.select(1), TypeError, "mode", "1"),
    ]


# -- the public Python API: moe_verify, reference, optimized, tolerance (issue 27) ---------------

SMALL = dict(TINY, alignment=32)


@functools.cache
def _small_inputs() -> MoEInputs:
    return make_inputs(MoEProblem(**SMALL), "cpu")


@functools.cache
def _golden_trace() -> Trace:
    return reference.run(MoEProblem(**SMALL), _small_inputs(), 0)


def _verify(**kwargs: object) -> object:
    from moe_verify import verify

    return verify(MoEProblem(**SMALL), **kwargs)


def _spoiled(path: str, value: float, at: tuple[int, ...] = (0, 0)) -> MoEInputs:
    """The small inputs with one element of `path` ('hidden_states', 'w13_q.scale', ...) set to
    `value` (a NaN code 0x7F for fp8 weights)."""
    x = _small_inputs()
    name, _, part = path.partition(".")
    if not part:
        t = getattr(x, name).clone()
        t[at] = value
        return dataclasses.replace(x, **{name: t})
    w = getattr(x, name)
    t = getattr(w, part).clone()
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8)[at] = 0x7F  # e4m3fn's NaN code
    else:
        t[at] = value
    return dataclasses.replace(x, **{name: dataclasses.replace(w, **{part: t})})


def _file_path() -> str:
    """A path under a regular file (this test module: it always exists and is never written), so
    no directory can be made there."""
    return str(Path(__file__).resolve() / "dumps")


def _public_api_rows() -> list[Bad]:
    from moe_verify.run import verify as verification

    nan, inf = math.nan, math.inf
    p = MoEProblem(**SMALL)
    rows = [
        bad("verify-backend-int", lambda: _verify(backend=42), TypeError, "backend", "42"),
        bad(
            "verify-backend-unknown-name",
            lambda: _verify(backend="banana"),
            ValueError,
            "backend",
            "'banana'",
        ),
        bad(
            "verify-backend-missing-class",
            lambda: _verify(backend="moe_verify.examples:NoSuchKernel"),
            ValueError,
            "backend",
            "NoSuchKernel",
        ),
        bad(
            "verify-compare_device-banana",
            lambda: _verify(compare_device="banana"),
            ValueError,
            "compare_device",
            "'banana'",
        ),
        bad(
            "verify-compare_device-int",
            lambda: _verify(compare_device=3),
            TypeError,
            "compare_device",
            "3",
        ),
        # parses, but no machine has a hundredth GPU: refused before the case runs to the end
        bad(
            "verify-compare_device-absent",
            lambda: _verify(compare_device="cuda:99"),
            ValueError,
            "compare_device",
            "'cuda:99'",
            "not usable here",
        ),
        bad("verify-device-banana", lambda: _verify(device="banana"), ValueError, "device"),
        bad(
            "verify-device-absent",
            lambda: _verify(device="cuda:99"),
            ValueError,
            "device",
            "'cuda:99'",
        ),
        bad(
            "verify-dump_dir-under-a-file",
            lambda: _verify(dump_dir=_file_path()),
            ValueError,
            "dump_dir",
            "is a file",
        ),
        bad(
            "verify-plot_dir-under-a-file",
            lambda: _verify(plot_dir=_file_path()),
            ValueError,
            "plot_dir",
            "is a file",
        ),
        bad(
            "verify-problem-dict",
            lambda: verification.verify(dict(SMALL)),
            TypeError,
            "problem",
            "dict",
        ),
        bad(
            "verify_rank-rank-past-the-topology",
            lambda: verification.verify_rank(
                p,
                _small_inputs(),
                reference.ReferenceBackend(),
                reference.ReferenceBackend(),
                9,
                (Mode.ISOLATED,),
            ),  # fmt: skip
            ValueError,
            "rank",
            "9",
        ),
        bad(
            "verify_rank-modes-string",
            lambda: verification.verify_rank(
                p,
                _small_inputs(),
                reference.ReferenceBackend(),
                reference.ReferenceBackend(),
                0,
                "isolated",
            ),  # fmt: skip
            TypeError,
            "modes",
            "'isolated'",
        ),
        bad(
            "verify_rank-modes-unknown",
            lambda: verification.verify_rank(
                p,
                _small_inputs(),
                reference.ReferenceBackend(),
                reference.ReferenceBackend(),
                0,
                ("iso",),
            ),  # fmt: skip
            ValueError,
            "modes",
            "'iso'",
        ),
        # NaN and Inf in given inputs: named by tensor and count, before the golden runs
        bad(
            "verify-inputs-hidden_states-nan",
            lambda: _verify(inputs=_spoiled("hidden_states", nan)),
            ValueError,
            "inputs.hidden_states",
            "1 NaN",
        ),
        bad(
            "check_inputs-router_logits-inf",
            lambda: inputs_mod.check_inputs(p, _spoiled("router_logits", -inf)),
            ValueError,
            "inputs.router_logits",
            "1 Inf",
        ),
        bad(
            "check_inputs-w13-nan",
            lambda: inputs_mod.check_inputs(p, _spoiled("w13", nan, (0, 0, 0))),
            ValueError,
            "inputs.w13",
            "1 NaN",
        ),
        bad(
            "check_inputs-w13_q-scale-inf",
            lambda: inputs_mod.check_inputs(p, _spoiled("w13_q.scale", inf, (1, 0, 0))),
            ValueError,
            "inputs.w13_q.scale",
            "1 Inf",
        ),
        bad(
            "check_inputs-w2_q-nan-code",
            lambda: inputs_mod.check_inputs(p, _spoiled("w2_q.q", nan, (3, 5, 7))),
            ValueError,
            "inputs.w2_q.q",
            "1 NaN",
        ),
        bad(
            "make_inputs-device-absent",
            lambda: make_inputs(p, "cuda:99"),
            ValueError,
            "device",
            "'cuda:99'",
        ),
        # the golden: run, and its layout, gather and GEMM helpers
        bad("reference.run-problem-dict", lambda: reference.run({}, None), TypeError, "problem"),
        bad(
            "reference.run-inputs-none",
            lambda: reference.run(p, None),
            TypeError,
            "inputs",
            "None",
        ),
        bad(
            "reference.run-rank-string",
            lambda: reference.run(p, _small_inputs(), "0"),
            TypeError,
            "rank",
            "'0'",
        ),
        bad(
            "OptimizedBackend.run-rank-past-the-topology",
            lambda: OptimizedBackend().run(p, _small_inputs(), 1),
            ValueError,
            "rank",
            "1",
        ),
        bad(
            "OptimizedBackend-exact_m_sum-1",
            lambda: OptimizedBackend(exact_m_sum=1),
            TypeError,
            "exact_m_sum",
            "1",
        ),
    ]
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    for kind, expert_map, exc, needle in (
        ("float", torch.tensor([0.0, 1.0, -1.0, -1.0]), ValueError, "float32"),
        ("bool", torch.tensor([False, True, True, True]), ValueError, "bool"),
        ("2d", torch.tensor([[0, 1], [-1, -1]]), ValueError, "(2, 2)"),
        ("list", [0, 1, -1, -1], TypeError, "[0, 1, -1, -1]"),
        ("past-E_l", torch.tensor([0, 1, 5, -1]), ValueError, "[-1, 5]"),
    ):
        rows.append(
            bad(
                f"reference.permute_plan-expert_map-{kind}",
                lambda m=expert_map: layout.permute_plan(ids, 2, 32, m),
                exc,
                "expert_map",
                needle,
            )
        )
        if kind != "past-E_l":  # local_expert_ids knows no E_l
            rows.append(
                bad(
                    f"reference.local_expert_ids-expert_map-{kind}",
                    lambda m=expert_map: layout.local_expert_ids(ids, m),
                    exc,
                    "expert_map",
                    needle,
                )
            )
    rows += [
        bad(
            "reference.local_expert_ids-id-past-the-map",
            lambda: layout.local_expert_ids(ids, torch.tensor([0, 1, -1])),
            ValueError,
            "topk_ids",
            "max id 3",
        ),
        bad(
            "reference.permute_plan-num_local_experts-float",
            lambda: layout.permute_plan(ids, 4.0, 32),
            TypeError,
            "num_local_experts",
            "4.0",
        ),
        bad(
            "reference.expert_counts-float-ids",
            lambda: layout.expert_counts(ids.float(), 4),
            ValueError,
            "local_ids",
            "float32",
        ),
        bad(
            "reference.expert_counts-num_local_experts--1",
            lambda: layout.expert_counts(ids.long(), -1),
            ValueError,
            "num_local_experts",
            "-1",
        ),
        bad(
            "reference.m_indices_from_expert_ends-float-ends",
            lambda: layout.m_indices_from_expert_ends(torch.tensor([1.0, 2.0]), 64, 32),
            ValueError,
            "expert_ends",
            "float32",
        ),
        bad(
            "reference.m_indices_from_expert_ends-alignment-0",
            lambda: layout.m_indices_from_expert_ends(torch.tensor([1, 2]), 64, 0),
            ValueError,
            "alignment",
            "0",
        ),
        bad(
            "reference.gather-expert_map-float",
            lambda: gather_ref.gather(
                torch.zeros(64, 128, dtype=torch.bfloat16),
                ids,
                torch.ones(2, 2),
                ids,
                torch.tensor([0.0, 1.0, 2.0, 3.0]),
            ),  # fmt: skip
            ValueError,
            "expert_map",
            "float32",
        ),
        bad(
            "reference.gather-topk_weights-int",
            lambda: gather_ref.gather(torch.zeros(64, 128, dtype=torch.bfloat16), ids, ids, ids),
            ValueError,
            "topk_weights",
            "int32",
        ),
    ]
    a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    for group, needle in ((0, "0"), (-128, "-128"), (96, "group=96"), (64.0, "64.0")):
        rows.append(
            bad(
                f"reference.dequantize_activations-group-{group!r}",
                lambda g=group: gemm_ref.dequantize_activations(a, torch.ones(4, 1), g),
                ValueError,
                "group",
                needle,
            )
        )
    rows.append(
        bad(
            "reference.grouped_gemm-a_group-0",
            lambda: gemm_ref.grouped_gemm(
                a, torch.ones(4, 1), 0, _small_inputs().w13_q, torch.zeros(4, dtype=torch.int32)
            ),
            ValueError,
            "a_group",
            "0",
        )
    )
    x = torch.zeros(4, 128)
    for group in (-1, 96, 64.0):
        rows.append(
            bad(
                f"reference.quantize_fp8_groups-group-{group!r}",
                lambda g=group: formats.quantize_fp8_groups(x, group=g),
                ValueError,
                "group",
                str(group),
            )
        )
    # tolerance: the comparison's entry points
    g = _golden_trace
    rows += [
        bad(
            "tolerance.compare-mode-iso",
            lambda: tolerance.compare(g(), g(), p, mode="iso"),
            ValueError,
            "mode",
            "'iso'",
        ),
        bad(
            "tolerance.compare-device-banana",
            lambda: tolerance.compare(g(), g(), p, device="banana"),
            ValueError,
            "device",
            "'banana'",
        ),
        bad(
            "tolerance.compare-golden-none",
            lambda: tolerance.compare(None, g(), p),
            TypeError,
            "golden",
            "None",
        ),
        bad(
            "tolerance.compare-problem-dict",
            lambda: tolerance.compare(g(), g(), dict(SMALL)),
            TypeError,
            "problem",
            "dict",
        ),
        bad(
            "tolerance.compare-stages-unknown",
            lambda: tolerance.compare(g(), g(), p, stages=["permutation"]),
            ValueError,
            "stage",
            "'permutation'",
        ),
        bad(
            "tolerance.compare_stage-stage-unknown",
            lambda: tolerance.compare_stage("gemm3", g(), g(), p),
            ValueError,
            "stage",
            "'gemm3'",
        ),
        bad(
            "tolerance.keyed_values-mode-both",
            lambda: tolerance.keyed_values("gemm1", g(), g(), p, mode="both"),
            ValueError,
            "mode",
            "'both'",
        ),
        bad(
            "tolerance.policy_for-problem-dict",
            lambda: tolerance.policy_for("gemm1", dict(SMALL)),
            TypeError,
            "problem",
            "dict",
        ),
        bad(
            "tolerance.policy_for-mode-iso",
            lambda: tolerance.policy_for("gemm1", p, "iso"),
            ValueError,
            "mode",
            "'iso'",
        ),
    ]
    return rows


CATALOGUE: list[Bad] = [
    *_problem_field_rows(),
    *_problem_rows(),
    *_topology_rows(),
    *_activation_rows(),
    *_from_dict_rows(),
    *_check_inputs_rows(),
    *_m_sum_rows(),
    *_kernel_rows(),
    *_reference_quant_rows(),
    *_deepgemm_rows(),
    *_misc_rows(),
    *_public_api_rows(),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in CATALOGUE])
def test_bad_input_is_refused_clearly(row: Bad) -> None:
    with pytest.raises(Exception) as info:
        row.call()
    exc = info.value
    assert not isinstance(exc, GENERIC), f"{row.id}: a generic {type(exc).__name__}: {exc}"
    assert isinstance(exc, row.exc), (
        f"{row.id}: expected {row.exc.__name__}, got {type(exc).__name__}: {exc}"
    )
    message = str(exc)
    missing = [n for n in row.needles if n not in message]
    assert not missing, f"{row.id}: the message does not name {missing}: {message!r}"


def test_catalogue_ids_are_unique() -> None:
    ids = [r.id for r in CATALOGUE]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def test_tp_given_as_a_string_is_tp() -> None:
    """Topology("tp", 2) used to become EP silently (the kind was compared by identity)."""
    topo = Topology("tp", 2)
    assert topo.kind is TopologyKind.TP
    assert str(topo) == "tp2"
    assert tiny(intermediate=256, topology=topo).intermediate_per_rank == 128


# Every curated case, shrunk where it is large, so make_inputs stays in milliseconds: the rows
# (routing, topology, recipe, shared experts) are what check_inputs reads.
def _small(p: MoEProblem) -> MoEProblem:
    if p.tokens * p.hidden * p.intermediate * p.num_experts <= 1 << 24:
        return p
    return p.replace(tokens=min(p.tokens, 16), num_experts=min(p.num_experts, 16))


CURATED = [
    pytest.param(_small(p), id=f"{name}-{p.id}")
    for name in ("smoke", "topology")
    for p in cases.preset(name)
]


@pytest.mark.parametrize("problem", CURATED)
def test_make_inputs_outputs_pass_check_inputs(problem: MoEProblem) -> None:
    inputs_mod.check_inputs(problem, make_inputs(problem, "cpu"))


def test_small_default_problem_passes_preflight() -> None:
    _preflight(MoEProblem(), "cpu")
    _preflight(tiny(), "meta")  # memory unknown: not checked


def test_preflight_names_the_largest_tensor() -> None:
    from moe_verify.run.preflight import estimate

    est = estimate(HUGE)
    big = est.largest
    assert big.bytes_each == max(i.bytes_each for i in est.items)
    with pytest.raises(ValueError) as info:
        _preflight(HUGE, "cpu")
    assert big.name in str(info.value) and str(list(big.shape)) in str(info.value)
