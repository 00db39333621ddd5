"""The bad-input catalogue (tests/cli/bad_input.py), the vocabulary's part: MoEProblem's fields
and combinations, Topology, Activation, MoEProblem.from_dict and Mode.select."""

from __future__ import annotations

import math

import pytest
import torch

from moe_verify.spec import Activation, Mode, MoEProblem, Placement, Topology, TopologyKind
from tests.cli.bad_input import GROUPED, Bad, bad, check_refused_clearly, params, tiny

pytestmark = pytest.mark.cpu


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
                ("router_weight", "inputs"),
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
                ("router_weight", 1),
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
            "MoEProblem-masked-mxfp8",
            lambda: tiny(recipe="mxfp8", scale_fmt="ue8m0_packed", grouped_layout="masked"),
            ValueError,
            "masked layout",
            "mxfp8",
        ),
        bad(
            "MoEProblem-ep-ll-swigluoai",
            lambda: tiny(activation="swigluoai", topology="ep:2+ll"),
            ValueError,
            "ep+ll",
            "swigluoai",
        ),
        # the router weight on the input: top-1 only, weights other than 1, no provenance tags
        bad(
            "MoEProblem-router_weight-input-top2",
            lambda: tiny(router_weight="input", renormalize=False),
            ValueError,
            "MoEProblem.router_weight",
            "topk=2",
        ),
        bad(
            "MoEProblem-router_weight-input-weights-all-one",
            lambda: tiny(router_weight="input", topk=1),
            ValueError,
            "MoEProblem.router_weight",
            "weight 1.0",
            "MoEProblem.renormalize",
        ),
        bad(
            "MoEProblem-router_weight-input-provenance",
            lambda: tiny(router_weight="input", topk=1, renormalize=False, provenance=True),
            ValueError,
            "MoEProblem.router_weight",
            "provenance",
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


def _mode_rows() -> list[Bad]:
    return [
        bad("Mode.select-iso", lambda: Mode.select("iso"), ValueError, "mode", "'iso'"),
        bad("Mode.select-BOTH", lambda: Mode.select("BOTH"), ValueError, "mode", "'BOTH'"),
        bad("Mode.select-empty", lambda: Mode.select(""), ValueError, "mode", "''"),
        bad("Mode.select-none", lambda: Mode.select(None), TypeError, "mode", "None"),
        bad("Mode.select-int", lambda: Mode.select(1), TypeError, "mode", "1"),
    ]


CATALOGUE: list[Bad] = [
    *_problem_field_rows(),
    *_problem_rows(),
    *_topology_rows(),
    *_activation_rows(),
    *_from_dict_rows(),
    *_mode_rows(),
]


@pytest.mark.parametrize("row", params(CATALOGUE))
def test_bad_input_is_refused_clearly(row: Bad) -> None:
    check_refused_clearly(row)


def test_tp_given_as_a_string_is_tp() -> None:
    """Topology("tp", 2) used to become EP silently (the kind was compared by identity)."""
    topo = Topology("tp", 2)
    assert topo.kind is TopologyKind.TP
    assert str(topo) == "tp2"
    assert tiny(intermediate=256, topology=topo).intermediate_per_rank == 128
