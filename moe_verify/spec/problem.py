"""The shared vocabulary: recipes, scale formats, topologies, the problem, inputs and the Trace.

Every backend (the golden in `reference/`, the DeepGEMM path in `optimized/`, a user's own kernels)
speaks these types, so traces from any two of them compare stage by stage. Nothing here computes
MoE math; it only names things and validates them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

# Bounds of a problem (documented maxima, deliberately above every model vLLM serves: DeepSeek-V3
# has H=7168, E=256; Llama-405B H=16384; Kimi-K2 E=384). They keep a typo (an extra zero, a size in
# bytes) from allocating or spawning without bound: `ep:100000` used to hang building 100000 ranks.
MAX_RANKS = 64
MAX_TOKENS = 1 << 20
MAX_HIDDEN = 1 << 16
MAX_INTERMEDIATE = 1 << 16
MAX_EXPERTS = 4096
MAX_SHARED_EXPERTS = 64
# Every row padding real stacks use (vLLM's Triton BLOCK_SIZE_M 16..256, DeepGEMM's mk alignment
# 32..256 by arch and M) is a multiple of 8; the suite also takes 8 itself (its tiny problems) and
# paddings that are not powers of two (96), which the golden and both engines handle.
ALIGNMENT_STEP = 8
MAX_ALIGNMENT = 1024
# torch.Generator.manual_seed takes [-2^63, 2^64); non-negative seeds keep ids readable, and the
# headroom keeps `seed + i` (calibration draws) legal.
MAX_SEED = (1 << 63) - 1

_E = TypeVar("_E", bound=enum.StrEnum)


def _got(value: object) -> str:
    """`value` as an error message shows it: repr and type."""
    return f"{value!r} ({type(value).__name__})"


def check_int(arg: str, value: object, low: int, high: int) -> int:
    """`value` as an int in [low, high]: TypeError for a non-int (bools and floats included, so
    64.5 or True never become sizes), ValueError out of range."""
    want = f"an int in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{arg}: expected {want}, got {_got(value)}")
    if not low <= value <= high:
        raise ValueError(f"{arg}: expected {want}, got {value}")
    return int(value)


def check_bool(arg: str, value: object) -> bool:
    """A real bool: a string such as 'no' is truthy and would silently mean True."""
    if not isinstance(value, bool):
        raise TypeError(f"{arg}: expected True or False, got {_got(value)}")
    return value


def check_float(arg: str, value: object, *, positive: bool = False) -> float:
    """A finite real number (int or float, not bool), > 0 when `positive`."""
    want = "a finite number" + (" > 0" if positive else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{arg}: expected {want}, got {_got(value)}")
    if not math.isfinite(value) or (positive and not value > 0):
        raise ValueError(f"{arg}: expected {want}, got {value!r}")
    return float(value)


def check_enum(arg: str, value: object, typ: type[_E]) -> _E:
    """A member of `typ`, or exactly one of its values as a string (CLI, JSON round trips)."""
    if isinstance(value, typ):
        return value
    allowed = ", ".join(repr(v.value) for v in typ)
    if not isinstance(value, str):
        raise TypeError(f"{arg}: expected a {typ.__name__} or one of {allowed}, got {_got(value)}")
    try:
        return typ(value)
    except ValueError:
        raise ValueError(f"{arg} must be one of {allowed}; got {value!r}") from None


class Stage(enum.StrEnum):
    """Stage names of one rank's staged forward (DESIGN.md "stage contract"), plus the cross-rank
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


# One rank's stages in order: the contiguous layout, and the batched low-latency one (ep:N+ll).
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
LL_STAGES: tuple[Stage, ...] = (
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
# Each stage's per-slot outputs: [T, k], indexed like route's topk_ids, so a token's slot order
# runs through them.
PER_SLOT_OUTPUTS: dict[Stage, tuple[str, ...]] = {
    Stage.ROUTE: ("topk_ids", "topk_weights"),
    Stage.PERMUTE: ("inv_perm",),
    Stage.DISPATCH: ("slot", "slot_expert"),
}


class Mode(enum.StrEnum):
    """How the tested backend's stages are fed (DESIGN.md "Two comparison modes")."""

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


class Status(enum.StrEnum):
    """Verdict of one compared stage (or one case)."""

    PASS = "pass"
    FAIL = "fail"  # a check failed
    SKIP = "skip"  # not compared here (the reason says why); never a pass
    ERROR = "error"  # a side raised, or the comparison could not run

    @property
    def failing(self) -> bool:
        return self in (Status.FAIL, Status.ERROR)


class GroupedLayout(enum.StrEnum):
    """How the contiguous grouped GEMMs learn each row's expert (DESIGN.md "stage contract").

    Both come from one permute plan; `permute` outputs both, and the problem says which one the
    GEMMs and act_quant consume.
    """

    AUTO = "auto"  # as vLLM chooses for the recipe, scale format, activation and GPU arch
    M_INDICES = "m_indices"  # per-row local expert, -1 on padding (the seed article's layout)
    PSUM = (
        "psum"  # per-expert cumulative row ends (DeepGEMM use_psum_layout=True); gap rows skipped
    )


class MSumRecipe(enum.StrEnum):
    """The legitimate formulas for align's M_sum (DESIGN.md "Legitimate recipes", ref §2.3).

    Each is a multiple of the alignment A and at least the exact sum, so every one is a valid
    M_sum; a backend may declare the one it implements (the align stage's "recipe" entry).
    """

    MIN_ACTIVE_BOUND = "min_active_bound"  # round_up(M*k + min(M*k, E_l)*(A-1), A): vLLM >= 0.30
    ALL_EXPERTS_BOUND = "all_experts_bound"  # round_up(M*k + E_l*(A-1), A): older vLLM
    EXACT_COUNTS = "exact_counts"  # sum_e round_up(count_e, A): counts on the host (DeepEP HT)


class InputQuantRecipe(enum.StrEnum):
    """vLLM's two 1 x 128 input quantizers (DESIGN.md "Legitimate recipes"; reference/formats.py
    models both, docs/tolerance.md#quant_input-recipes says where they differ)."""

    CUDA_DIVISION = "cuda_division"  # per_token_group_quant.cu: amax / 448, scale floor 1e-10
    TRITON_RECIPROCAL = "triton_reciprocal"  # fp8_utils._per_token_group_quant_fp8: amax * (1/448)


class ActQuantRecipe(enum.StrEnum):
    """vLLM's three SwiGLU + FP8 requant kernels (DESIGN.md "Legitimate recipes";
    reference/activation.py models each), and the Triton two with the hardware's gate."""

    PACKED = "packed"  # silu_mul_quant_fp8_packed_triton: fp32, one bf16 rounding (UE8M0_PACKED)
    COLMAJOR = "colmajor"  # silu_mul_per_token_group_quant_fp8_colmajor: silu_and_mul's roundings
    BF16_STEPS = "bf16_steps"  # persistent_masked_m_silu_mul_quant (CUDA, LL): every step in bf16
    # The two Triton kernels with the gate read from the table recorded on an H200 (Triton 3.6):
    # tl.exp and the approximate division as that GPU computes them (reference/gate_table.py).
    PACKED_SM90_TRITON = "packed_sm90_triton"
    COLMAJOR_SM90_TRITON = "colmajor_sm90_triton"


class GemmRecipe(enum.StrEnum):
    """What a GEMM stage's live rows are held to (DESIGN.md "Legitimate recipes"; docs/tolerance.md
    "Zero tolerance on SM90")."""

    FP32_DEQUANT = "fp32_dequant"  # bounded against exact fp32 math on the same fp8 operands
    TENSOR_CORE = "tensor_core"  # bit for bit against the Hopper tensor core's block accumulation


class Engine(enum.StrEnum):
    """The GEMM engine of the optimized path (DESIGN.md "Recipes and scale formats")."""

    AUTO = "auto"  # DeepGEMM where it can run this problem, else Triton
    DEEPGEMM = "deepgemm"
    TRITON = "triton"


# ep:N+ll batches hold whole blocks of this many rows (the masked GEMM's largest BLOCK_M).
LL_BLOCK_ROWS = 128


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


FP8_MAX = 448.0
E2M1_MAX = 6.0


class Recipe(enum.StrEnum):
    """Quantization recipe of one MoE layer (DESIGN.md "Recipes and scale formats")."""

    FP8_BLOCK = "fp8_block"  # e4m3 activations 1x128, e4m3 weights 128x128 blocks
    MXFP8 = "mxfp8"  # e4m3 activations and weights, 1x32 groups, E8M0 scales
    MXFP4_W4A8 = "mxfp4_w4a8"  # e4m3 activations 1x128, E2M1 weights 1x32 with E8M0 scales

    @property
    def act_group(self) -> int:
        """K elements sharing one activation scale."""
        return 32 if self is Recipe.MXFP8 else 128

    @property
    def weight_block(self) -> tuple[int, int]:
        """(rows, K elements) sharing one weight scale."""
        return (128, 128) if self is Recipe.FP8_BLOCK else (1, 32)

    @property
    def allowed_scale_fmts(self) -> tuple[ScaleFmt, ...]:
        if self is Recipe.FP8_BLOCK:
            return (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED)
        if self is Recipe.MXFP8:
            # MX activations carry E8M0 bytes; the GEMM consumes them packed four per int32.
            return (ScaleFmt.UE8M0_PACKED,)
        return (ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED)


class ScaleFmt(enum.StrEnum):
    """How activation scales are stored (vLLM's DeepGemmQuantScaleFMT)."""

    FLOAT32 = "float32"  # plain fp32 amax/448
    FLOAT32_CEIL_UE8M0 = "float32_ceil_ue8m0"  # fp32 storage, rounded up to a power of two (SM90)
    UE8M0_PACKED = "ue8m0_packed"  # exponent bytes, 4 per int32, MN-major TMA-aligned (SM100)

    @property
    def is_ue8m0(self) -> bool:
        """True when every scale is a power of two (weights are requantized to UE8M0 too)."""
        return self is not ScaleFmt.FLOAT32


@dataclass(frozen=True)
class Activation:
    """Gated activation on [gate | up] halves of GEMM1's output (gate = first half).

    silu:      y = silu(g) * u
    swigluoai: y = (u + beta) * g * sigmoid(alpha * g)
    With `limit`, the gate is clamped from above only and up on both sides, before the activation.
    """

    kind: str = "silu"
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise TypeError(
                f"Activation.kind: expected 'silu' or 'swigluoai', got {_got(self.kind)}"
            )
        if self.kind not in ("silu", "swigluoai"):
            raise ValueError(f"Activation.kind: expected 'silu' or 'swigluoai', got {self.kind!r}")
        object.__setattr__(self, "alpha", check_float("Activation.alpha", self.alpha))
        object.__setattr__(self, "beta", check_float("Activation.beta", self.beta))
        if self.limit is not None:
            limit = check_float("Activation.limit (the clamp)", self.limit, positive=True)
            object.__setattr__(self, "limit", limit)
        if self.kind == "silu" and (self.alpha != 1.0 or self.beta != 0.0):
            raise ValueError(
                f"Activation: silu has alpha=1, beta=0; got alpha={self.alpha}, beta={self.beta} "
                "(use kind='swigluoai')"
            )

    @property
    def tag(self) -> str:
        if self.kind == "silu" and self.limit is None:
            return "silu"
        parts = [self.kind]
        if self.kind == "swigluoai":
            parts.append(f"a{self.alpha:g}b{self.beta:g}")
        if self.limit is not None:
            parts.append(f"L{self.limit:g}")
        return "-".join(parts)

    @staticmethod
    def parse(text: str) -> Activation:
        """'silu', 'silu:L7', 'swigluoai', 'swigluoai:1.702:1.0:7.0' (alpha:beta:limit)."""
        syntax = "'silu[:L<limit>]' or 'swigluoai[:alpha[:beta[:limit]]]'"
        if not isinstance(text, str):
            raise TypeError(f"activation: expected a string {syntax}, got {_got(text)}")
        kind, _, rest = text.partition(":")
        args = [a for a in rest.split(":") if a] if rest else []
        if kind == "silu":
            if len(args) > 1 or (args and not args[0].startswith("L")):
                raise ValueError(f"activation {text!r}: silu takes only a limit, as 'silu:L7'")
            return Activation(
                "silu", limit=_parse_number(text, "limit", args[0][1:]) if args else None
            )
        if kind == "swigluoai":
            if len(args) > 3:
                raise ValueError(
                    f"activation {text!r}: swigluoai takes at most alpha:beta:limit, got "
                    f"{len(args)} values"
                )
            names = ("alpha", "beta", "limit")
            vals = [_parse_number(text, n, a) for n, a in zip(names, args, strict=False)]
            alpha, beta, limit = (vals + [1.702, 1.0, 7.0][len(vals) :])[:3]
            return Activation("swigluoai", alpha, beta, limit)
        raise ValueError(f"activation {text!r}: expected {syntax}")


def _parse_number(text: str, name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"activation {text!r}: {name}: expected a number, got {value!r}") from None


class Routing(enum.StrEnum):
    """How topk ids and weights are produced by `make_inputs` (each names the edge it exercises)."""

    SOFTMAX = "softmax"  # softmax top-k over random logits, renormalized
    GROUPED = "grouped"  # DeepSeek-V3: sigmoid + correction bias, top groups, routed scaling
    UNIFORM = "uniform"  # every expert gets (almost) the same number of slots
    SKEW = "skew"  # one hot expert takes about half of all slots
    EMPTY_FIRST = "empty_first"  # expert 0 receives nothing
    EMPTY_MIDDLE = "empty_middle"  # expert E//2 receives nothing
    EMPTY_LAST = "empty_last"  # expert E-1 receives nothing
    ONE_EXPERT = "one_expert"  # every token's first slot goes to one expert, the rest are -1
    INVALID_SLOTS = "invalid_slots"  # about a quarter of the slots are -1, some tokens entirely
    DUPLICATES = "duplicates"  # ids drawn with replacement: a token may hit one expert twice


class TopologyKind(enum.StrEnum):
    TP = "tp"  # intermediate split across ranks; partial outputs summed
    EP = "ep"  # experts split across ranks (expert_map); every rank sees every token
    EP_HT = "ep+ht"  # DeepEP high-throughput: tokens dispatched to owners, exact counts
    EP_LL = "ep+ll"  # DeepEP low-latency: batched [E_local, max_tokens, H] + masked_m


class Placement(enum.StrEnum):
    LINEAR = "linear"  # contiguous slices; the first E % N ranks get one more expert
    ROUND_ROBIN = "round_robin"  # expert e lives on rank e % N
    EXPLICIT = "explicit"  # given per-rank lists of logical experts (replicas allowed)


_TOPOLOGY_RE = re.compile(r"^(tp|ep):(\d+)(?::(linear|round_robin))?(\+ht|\+ll)?$")


def _explicit_lists(ranks: object) -> tuple[tuple[int, ...], ...]:
    """Per-rank expert lists as tuples of ints >= 0 (whether they cover 0..E-1 is the problem's
    check: a topology does not know E)."""
    want = "a list of per-rank lists of expert ids"
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"Topology.explicit: expected {want}, got {_got(ranks)}")
    out = []
    for r, experts in enumerate(ranks):
        if isinstance(experts, (str, bytes)) or not isinstance(experts, Sequence):
            raise TypeError(
                f"Topology.explicit[{r}]: expected a list of expert ids, got {_got(experts)}"
            )
        out.append(
            tuple(
                check_int(f"Topology.explicit[{r}][{j}]", e, 0, MAX_EXPERTS - 1)
                for j, e in enumerate(experts)
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Topology:
    """Parallel layout of one MoE layer, emulated in one process or run for real.

    `explicit` (Placement.EXPLICIT only) lists, per rank, the logical experts that rank hosts; an
    expert listed on several ranks is a redundant (EPLB-style) replica.
    """

    kind: TopologyKind = TopologyKind.TP
    size: int = 1
    placement: Placement = Placement.LINEAR
    explicit: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        # A kind given as the string "tp" must mean TP: compared by identity, it used to fall
        # through to the EP branches.
        object.__setattr__(self, "kind", check_enum("Topology.kind", self.kind, TopologyKind))
        object.__setattr__(
            self, "placement", check_enum("Topology.placement", self.placement, Placement)
        )
        check_int("Topology.size (ranks)", self.size, 1, MAX_RANKS)
        if self.explicit is not None:
            object.__setattr__(self, "explicit", _explicit_lists(self.explicit))
        if self.kind is TopologyKind.TP and self.placement is not Placement.LINEAR:
            raise ValueError(
                f"Topology.placement: tp topologies have no expert placement, got "
                f"{self.placement.value!r}"
            )
        if (self.placement is Placement.EXPLICIT) != (self.explicit is not None):
            raise ValueError(
                f"Topology: placement 'explicit' and an explicit expert list go together, got "
                f"placement {self.placement.value!r} with explicit={self.explicit!r}"
            )
        if self.explicit is not None and len(self.explicit) != self.size:
            raise ValueError(
                f"Topology.explicit: expected {self.size} ranks (the size), got "
                f"{len(self.explicit)} lists"
            )
        if self.kind is TopologyKind.EP_HT and self.placement is not Placement.LINEAR:
            # vLLM downgrades HT to linear: its -1 remap assumes contiguous expert slices.
            raise ValueError(
                f"Topology.placement: ep+ht supports 'linear' only (as vLLM's DeepEP HT), got "
                f"{self.placement.value!r}"
            )

    @staticmethod
    def parse(text: str) -> Topology:
        """'tp:N', 'ep:N', 'ep:N:round_robin', 'ep:N+ht', 'ep:N+ll'; 'single' means tp:1."""
        syntax = "tp:N, ep:N, ep:N:round_robin, ep:N+ht or ep:N+ll (or single)"
        if not isinstance(text, str):
            raise TypeError(f"topology: expected a string {syntax}, got {_got(text)}")
        if text in ("single", "1"):
            return Topology()
        m = _TOPOLOGY_RE.match(text.strip())
        if m is None:
            raise ValueError(f"topology {text!r}: expected {syntax}")
        base, size, placement, suffix = m.groups()
        if base == "tp" and (placement or suffix):
            raise ValueError(f"topology {text!r}: placement and +ht/+ll apply to ep only")
        if not 1 <= int(size) <= MAX_RANKS:
            # Refused before anything builds per-rank state (ep:100000 used to hang).
            raise ValueError(
                f"topology {text!r}: expected a rank count in [1, {MAX_RANKS}], got {int(size)}"
            )
        kind = {None: TopologyKind.EP, "+ht": TopologyKind.EP_HT, "+ll": TopologyKind.EP_LL}[suffix]
        if base == "tp":
            kind = TopologyKind.TP
        return Topology(kind, int(size), Placement(placement or "linear"))

    @staticmethod
    def explicit_ep(ranks: Sequence[Sequence[int]]) -> Topology:
        """EP with, per rank, the logical experts it hosts (replicas allowed)."""
        lists = _explicit_lists(ranks)
        if not 1 <= len(lists) <= MAX_RANKS:
            raise ValueError(
                f"Topology.explicit: expected 1 to {MAX_RANKS} rank lists, got {len(lists)}"
            )
        return Topology(TopologyKind.EP, len(lists), Placement.EXPLICIT, lists)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return LL_STAGES if self.kind is TopologyKind.EP_LL else STAGES

    def __str__(self) -> str:
        if self.kind is TopologyKind.TP:
            return f"tp{self.size}"
        if self.placement is Placement.EXPLICIT:
            return f"ep{self.size}-explicit"
        text = f"ep{self.size}"
        if self.placement is Placement.ROUND_ROBIN:
            text += "-rr"
        if self.kind is TopologyKind.EP_HT:
            text += "-ht"
        if self.kind is TopologyKind.EP_LL:
            text += "-ll"
        return text


# Routing modes that fix ids and weights directly instead of routing logits (inputs.py).
_FIXED_ID_ROUTINGS = (
    Routing.UNIFORM,
    Routing.ONE_EXPERT,
    Routing.INVALID_SLOTS,
    Routing.DUPLICATES,
)


@dataclass(frozen=True)
class MoEProblem:
    """One MoE layer to verify: shapes, recipe, routing, topology and seed.

    `alignment` is the per-expert row padding A of the contiguous layout (DeepGEMM's BLOCK_M);
    `provenance` replaces random values with tagged ones that survive quantization, so a wrong
    row names the token and expert it came from. `ll_capacity` sizes the batches of the ep:N+ll
    layout (`ll_max_tokens`); `tiny_tokens` makes the first tokens tiny enough that every MXFP8
    group of them gets E8M0 byte 0 (moe_verify/inputs.py).
    """

    tokens: int = 64
    hidden: int = 256
    intermediate: int = 256
    num_experts: int = 8
    topk: int = 2
    recipe: Recipe = Recipe.FP8_BLOCK
    scale_fmt: ScaleFmt = ScaleFmt.FLOAT32
    activation: Activation = field(default_factory=Activation)
    routing: Routing = Routing.SOFTMAX
    topology: Topology = field(default_factory=Topology)
    seed: int = 0
    alignment: int = 128
    provenance: bool = False
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    shared_experts: int = 0  # DeepSeek-style shared experts: a dense MLP every token passes
    grouped_layout: GroupedLayout = GroupedLayout.AUTO
    ll_capacity: int = 0  # ep:N+ll rows per expert batch (DeepEP's max_tokens); 0: ll_max_tokens
    tiny_tokens: int = 0  # the first N tokens rescaled to |max| 2^-119 (inputs.py TINY_AMAX)

    def __post_init__(self) -> None:
        # Enum fields also take their exact strings (CLI, JSON round trips).
        for name, typ in (
            ("recipe", Recipe),
            ("scale_fmt", ScaleFmt),
            ("routing", Routing),
            ("grouped_layout", GroupedLayout),
        ):
            object.__setattr__(
                self, name, check_enum(f"MoEProblem.{name}", getattr(self, name), typ)
            )
        if isinstance(self.topology, str):
            object.__setattr__(self, "topology", Topology.parse(self.topology))
        elif not isinstance(self.topology, Topology):
            raise TypeError(
                f"MoEProblem.topology: expected a Topology or a string such as 'ep:4', got "
                f"{_got(self.topology)}"
            )
        if isinstance(self.activation, str):
            object.__setattr__(self, "activation", Activation.parse(self.activation))
        elif not isinstance(self.activation, Activation):
            raise TypeError(
                f"MoEProblem.activation: expected an Activation or a string such as 'silu', got "
                f"{_got(self.activation)}"
            )
        self._check_fields()
        self._validate()

    def _check_fields(self) -> None:
        """Each field on its own: type and bounds (normalized in place: a numpy int becomes an
        int, an int scaling factor a float)."""

        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("tokens", check_int("MoEProblem.tokens", self.tokens, 0, MAX_TOKENS))
        put("hidden", check_int("MoEProblem.hidden", self.hidden, 1, MAX_HIDDEN))
        put(
            "intermediate",
            check_int("MoEProblem.intermediate", self.intermediate, 1, MAX_INTERMEDIATE),
        )
        put("num_experts", check_int("MoEProblem.num_experts", self.num_experts, 1, MAX_EXPERTS))
        put("topk", check_int("MoEProblem.topk", self.topk, 1, MAX_EXPERTS))
        if self.topk > self.num_experts:
            raise ValueError(
                f"MoEProblem.topk must be in [1, num_experts={self.num_experts}], got {self.topk}"
            )
        put("seed", check_int("MoEProblem.seed", self.seed, 0, MAX_SEED))
        alignment = check_int("MoEProblem.alignment", self.alignment, ALIGNMENT_STEP, MAX_ALIGNMENT)
        if alignment % ALIGNMENT_STEP:
            raise ValueError(
                f"MoEProblem.alignment: expected a multiple of {ALIGNMENT_STEP} in "
                f"[{ALIGNMENT_STEP}, {MAX_ALIGNMENT}] (rows per expert segment), got {alignment}"
            )
        put("alignment", alignment)
        put("provenance", check_bool("MoEProblem.provenance", self.provenance))
        put("renormalize", check_bool("MoEProblem.renormalize", self.renormalize))
        put(
            "routed_scaling_factor",
            check_float(
                "MoEProblem.routed_scaling_factor", self.routed_scaling_factor, positive=True
            ),
        )
        put(
            "num_expert_group",
            check_int(
                f"MoEProblem.num_expert_group (at most num_experts={self.num_experts})",
                self.num_expert_group,
                1,
                self.num_experts,
            ),
        )
        put(
            "topk_group",
            check_int(
                f"MoEProblem.topk_group (at most num_expert_group={self.num_expert_group})",
                self.topk_group,
                1,
                self.num_expert_group,
            ),
        )
        put(
            "shared_experts",
            check_int("MoEProblem.shared_experts", self.shared_experts, 0, MAX_SHARED_EXPERTS),
        )
        put("ll_capacity", check_int("MoEProblem.ll_capacity", self.ll_capacity, 0, MAX_TOKENS))
        put(
            "tiny_tokens",
            check_int(
                f"MoEProblem.tiny_tokens (at most tokens={self.tokens})",
                self.tiny_tokens,
                0,
                self.tokens,
            ),
        )

    def _validate(self) -> None:
        """The fields together: combinations no backend can run, or that one would ignore."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"MoEProblem: {msg}")

        need(
            self.scale_fmt in self.recipe.allowed_scale_fmts,
            f"scale_fmt: recipe {self.recipe} takes scale_fmt in "
            f"{[str(f) for f in self.recipe.allowed_scale_fmts]}, got {self.scale_fmt}",
        )
        g = self.recipe.act_group
        need(
            self.hidden % g == 0,
            f"hidden={self.hidden} must be a multiple of {g} ({self.recipe} activation groups)",
        )
        bm, bk = self.recipe.weight_block
        tp = self.topology.size if self.topology.kind is TopologyKind.TP else 1
        need(
            self.intermediate % tp == 0,
            f"intermediate: expected a multiple of tp={tp} (it splits over the ranks), got "
            f"{self.intermediate}",
        )
        ip = self.intermediate // tp
        # GEMM2 reduces over I_p, grouped by the activation group; weight blocks must not straddle
        # a TP shard, or each rank would see half a 128x128 block.
        step = max(g, bk, bm if self.recipe is Recipe.FP8_BLOCK else 1)
        need(
            ip % step == 0,
            f"intermediate per rank={ip} (intermediate={self.intermediate} / tp={tp}) must be a "
            f"multiple of {step} for {self.recipe}",
        )
        need(
            self.hidden % bm == 0 or bm == 1,
            f"hidden={self.hidden} must be a multiple of {bm} ({self.recipe} weight blocks)",
        )
        self._validate_routing()
        if self.shared_experts:
            # The shared MLP is a dense layer sharded over all ranks (attention TP = ranks).
            shared = self.intermediate * self.shared_experts
            shard = shared // self.topology.size
            need(
                shared % self.topology.size == 0 and shard % step == 0,
                f"shared_experts: the shared intermediate (intermediate x shared_experts = "
                f"{shared}) must split into {self.topology.size} shards that are multiples of "
                f"{step}, got shared_experts={self.shared_experts}",
            )
        if self.topology.kind is TopologyKind.EP_LL:
            # vLLM's BatchedDeepGemmExperts: FP8 block, SILU, fp32 (or ceil) scales per 128
            # (packed UE8M0 there is an SM100 DeepEP mode with a batched layout not modelled yet).
            need(
                self.recipe is Recipe.FP8_BLOCK and self.scale_fmt is not ScaleFmt.UE8M0_PACKED,
                f"topology {self.topology}: ep+ll supports fp8_block with scale_fmt float32 or "
                f"float32_ceil_ue8m0, got recipe {self.recipe} with {self.scale_fmt}",
            )
            need(
                self.activation.kind == "silu",
                f"topology {self.topology}: ep+ll (BatchedDeepGemmExperts) supports activation "
                f"silu only, got {self.activation.tag}",
            )
        if self.ll_capacity:
            self._validate_ll_capacity()
        need(
            not (self.tiny_tokens and self.provenance),
            f"tiny_tokens={self.tiny_tokens} with provenance: rescaling a token to 2^-119 would "
            "erase the tags that name it",
        )
        if self.topology.placement is Placement.EXPLICIT:
            hosted = {e for r in self.topology.explicit or () for e in r}
            missing = sorted(set(range(self.num_experts)) - hosted)
            extra = sorted(hosted - set(range(self.num_experts)))
            need(
                not missing and not extra,
                f"topology: explicit placement must host every expert 0..{self.num_experts - 1} "
                f"and no other, got {list(self.topology.explicit or ())} (missing {missing}, "
                f"beyond num_experts {extra})",
            )

    def _validate_ll_capacity(self) -> None:
        """A given batch capacity: ep:N+ll only, whole 128-row blocks, room for every token."""
        cap, least = self.ll_capacity, _round_up(self.tokens, LL_BLOCK_ROWS)
        if self.topology.kind is not TopologyKind.EP_LL:
            raise ValueError(
                f"MoEProblem.ll_capacity: the batch capacity of the ep:N+ll layout (DeepEP's "
                f"max_tokens); topology {self.topology} has no batches, got ll_capacity={cap} "
                "(leave it 0)"
            )
        if cap % LL_BLOCK_ROWS:
            raise ValueError(
                f"MoEProblem.ll_capacity: expected a multiple of the {LL_BLOCK_ROWS}-row block "
                f"(DeepGEMM's masked GEMM reads whole blocks, `ll_max_tokens`), got {cap}"
            )
        if cap < least:
            raise ValueError(
                f"MoEProblem.ll_capacity: expected at least {least} (tokens={self.tokens} rounded "
                f"up to {LL_BLOCK_ROWS}-row blocks: every token may reach one expert), got {cap}"
            )

    def _validate_routing(self) -> None:
        """Routing parameters a routing mode would silently ignore are refused: only grouped
        routing applies routed_scaling_factor (reference/routing.py grouped_topk,
        optimized/routing.py _grouped), and only the router-driven modes renormalize (the
        structural ones fix ids and weights directly, moe_verify/inputs.py). num_expert_group and
        topk_group are left alone outside grouped routing: callers share one set of group
        parameters across routing modes (tests/reference/test_routing_inputs.py)."""
        r = self.routing
        if r is Routing.GROUPED:
            groups = self.num_expert_group
            if self.num_experts % groups:
                raise ValueError(
                    f"MoEProblem.num_expert_group: expected a divisor of num_experts="
                    f"{self.num_experts}, got {groups}"
                )
            kept = self.topk_group * (self.num_experts // groups)
            if self.topk > kept:
                raise ValueError(
                    f"MoEProblem.topk: expected at most the {kept} experts left after keeping "
                    f"topk_group={self.topk_group} of {groups} groups, got {self.topk}"
                )
        elif self.routed_scaling_factor != 1.0:
            raise ValueError(
                f"MoEProblem.routed_scaling_factor: expected 1.0 with routing {r.value!r} (only "
                f"'grouped' routing applies it), got {self.routed_scaling_factor!r}"
            )
        if r in _FIXED_ID_ROUTINGS and not self.renormalize:
            raise ValueError(
                f"MoEProblem.renormalize: expected True with routing {r.value!r} (it fixes ids and "
                "weights directly; renormalize applies to softmax, grouped, skew and empty_*), "
                "got False"
            )
        if r in (Routing.EMPTY_FIRST, Routing.EMPTY_MIDDLE, Routing.EMPTY_LAST):
            if self.topk >= self.num_experts:
                raise ValueError(
                    f"MoEProblem.topk: expected < num_experts={self.num_experts} with routing "
                    f"{r.value!r} (an expert must be left empty), got {self.topk}"
                )

    @property
    def stages(self) -> tuple[Stage, ...]:
        """This rank's stages: the topology's, then `shared` when there are shared experts."""
        return self.topology.stages + ((Stage.SHARED,) if self.shared_experts else ())

    @property
    def ll_max_tokens(self) -> int:
        """Rows of each local expert's batch in the ep:N+ll layout (M_max of the masked GEMM).

        DeepEP sizes its low-latency receive buffers from a configured capacity (vLLM: its DP
        chunk, 256 tokens by default, times the ranks), not from the batch at hand; here the
        tokens rounded up to whole 128-row blocks unless `ll_capacity` gives one (validated: whole
        blocks, at least that). DeepGEMM's masked GEMM needs whole blocks: it views the batches as
        one [E_l * M_max] matrix, so a block running past M_max reads and overwrites the next
        expert's rows (seen on the H200 at M_max = 20, docs/gpu-results.md).
        """
        return self.ll_capacity or _round_up(self.tokens, LL_BLOCK_ROWS)

    @property
    def intermediate_per_rank(self) -> int:
        tp = self.topology.size if self.topology.kind is TopologyKind.TP else 1
        return self.intermediate // tp

    @property
    def id(self) -> str:
        """Readable case id, e.g. fp8_block-ep4-T512-H2048-I768-E64-k8-skew."""
        parts = [
            str(self.recipe),
            str(self.topology),
            f"T{self.tokens}",
            f"H{self.hidden}",
            f"I{self.intermediate}",
            f"E{self.num_experts}",
            f"k{self.topk}",
            str(self.routing),
        ]
        if self.scale_fmt is not self.recipe.allowed_scale_fmts[0]:
            parts.append(
                {"float32_ceil_ue8m0": "ceil", "ue8m0_packed": "packed"}.get(
                    self.scale_fmt.value, self.scale_fmt.value
                )
            )
        if self.activation.tag != "silu":
            parts.append(self.activation.tag)
        if self.alignment != 128:
            parts.append(f"A{self.alignment}")
        if self.shared_experts:
            parts.append(f"sh{self.shared_experts}")
        if self.grouped_layout is not GroupedLayout.AUTO:
            parts.append(str(self.grouped_layout))
        if self.ll_capacity:
            parts.append(f"cap{self.ll_capacity}")
        if self.tiny_tokens:
            parts.append(f"tiny{self.tiny_tokens}")
        if self.provenance:
            parts.append("prov")
        if self.seed:
            parts.append(f"s{self.seed}")
        return "-".join(parts)

    def replace(self, **changes: object) -> MoEProblem:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        topo = self.topology
        return {
            "tokens": self.tokens,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "num_experts": self.num_experts,
            "topk": self.topk,
            "recipe": self.recipe.value,
            "scale_fmt": self.scale_fmt.value,
            "activation": dataclasses.asdict(self.activation),
            "routing": self.routing.value,
            "topology": {
                "kind": topo.kind.value,
                "size": topo.size,
                "placement": topo.placement.value,
                "explicit": [list(r) for r in topo.explicit] if topo.explicit else None,
            },
            "seed": self.seed,
            "alignment": self.alignment,
            "provenance": self.provenance,
            "renormalize": self.renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "shared_experts": self.shared_experts,
            "grouped_layout": self.grouped_layout.value,
            "ll_capacity": self.ll_capacity,
            "tiny_tokens": self.tiny_tokens,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> MoEProblem:
        """The inverse of `to_dict` (a dump's problem.json, --problem-json): every key present,
        no other; the values are checked as the constructor checks them. A key added after
        problems were first written (`_LATER_KEYS`) may be absent: a file without it was written
        when its default was the only behaviour."""
        if isinstance(d, Mapping):
            d = {**{k: v for k, v in _LATER_KEYS.items() if k not in d}, **d}
        d = dict(_exact_keys("problem", d, [f.name for f in dataclasses.fields(MoEProblem)]))
        # A hand-written file may also give the topology and activation as strings ('ep:4').
        if not isinstance(d["topology"], str):
            topo = _exact_keys("problem['topology']", d["topology"], _TOPOLOGY_KEYS)
            explicit = topo["explicit"]
            d["topology"] = Topology(
                topo["kind"],
                topo["size"],
                topo["placement"],
                None if explicit is None else _explicit_lists(explicit),
            )
        if not isinstance(d["activation"], str):
            act = _exact_keys("problem['activation']", d["activation"], _ACTIVATION_KEYS)
            d["activation"] = Activation(**act)
        return MoEProblem(**d)


_TOPOLOGY_KEYS = ("kind", "size", "placement", "explicit")
_LATER_KEYS: dict[str, object] = {"ll_capacity": 0, "tiny_tokens": 0}
_ACTIVATION_KEYS = tuple(f.name for f in dataclasses.fields(Activation))


def _exact_keys(arg: str, d: object, keys: Sequence[str]) -> Mapping[str, Any]:
    """`d` is a mapping with exactly `keys`: a typo'd key would otherwise be dropped silently, and
    a missing one would fall back to a default the dump never had."""
    if not isinstance(d, Mapping):
        raise TypeError(f"{arg}: expected a mapping with keys {list(keys)}, got {_got(d)}")
    unknown = sorted(str(k) for k in d if k not in keys)
    if unknown:
        raise ValueError(f"{arg}: unknown keys {unknown} (expected {list(keys)})")
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"{arg}: missing keys {missing} (expected {list(keys)})")
    return d


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


# The keys a trace stores for a stage that did not run (kept as data so dumps round-trip).
_SKIPPED = "skipped"
_ERROR = "error"
_VIOLATION = "violation"


@dataclass(frozen=True)
class StageFailure:
    """Why a stage of a trace has no usable outputs: skipped (with the reason), raised (the
    error), or returned outputs that break the stage contract (the violation)."""

    status: Status  # Status.SKIP, Status.ERROR, or Status.FAIL for a contract violation
    reason: str

    def __str__(self) -> str:
        word = {Status.SKIP: "skipped", Status.ERROR: "error", Status.FAIL: "contract violation"}
        return f"{word[self.status]}: {self.reason}"


class Trace:
    """Ordered mapping stage name -> named tensors (and host ints), one rank's staged forward.

    `trace["permute"]["m_indices"]`. Stages are appended in execution order; a stage may carry
    extra named entries (e.g. "engine" on GEMM stages). Non-tensor values (ints, strings) are
    allowed for host-side facts such as M_sum or the GEMM engine used. A stage that did not run
    is recorded with `add_skipped` or `add_error`, and `failure(stage)` says which and why.

    Two host entries have a fixed meaning: "engine" (the GEMM engine that ran a GEMM stage) and
    "recipe" (the legitimate rounding recipe a backend declares it implements for a stage with
    several, e.g. quant_input "triton_reciprocal"; DESIGN.md "Legitimate recipes"). Without a
    declared recipe a stage passes when it matches one legitimate recipe exactly.
    """

    def __init__(self, backend: str, rank: int = 0) -> None:
        self.backend = backend
        self.rank = rank
        self._stages: dict[str, dict[str, object]] = {}

    def add(self, stage: str, outputs: Mapping[str, object]) -> None:
        if stage in self._stages:
            raise ValueError(f"trace of {self.backend!r} already has stage {stage!r}")
        self._stages[stage] = dict(outputs)

    def add_skipped(self, stage: str, reason: str) -> None:
        """`stage` did not run here, for `reason` (e.g. "needs SM100"); never a pass."""
        self.add(stage, {_SKIPPED: reason})

    def add_error(self, stage: str, message: str) -> None:
        """`stage` raised `message`: reported as an error at that stage."""
        self.add(stage, {_ERROR: message})

    def add_violation(self, stage: str, message: str) -> None:
        """`stage` ran but broke the stage contract (a wrong dtype, shape or stride, an in-place
        write into its upstream or inputs): a failed check at that stage, and what it returned
        is not used downstream."""
        self.add(stage, {_VIOLATION: message})

    def failure(self, stage: str) -> StageFailure | None:
        """Why `stage` has no outputs (absent, skipped or raised), or None when it ran."""
        outs = self._stages.get(stage)
        if outs is None:
            return StageFailure(Status.SKIP, f"{self.backend} has no {stage} stage (not run)")
        if _ERROR in outs:
            return StageFailure(Status.ERROR, str(outs[_ERROR]))
        if _VIOLATION in outs:
            return StageFailure(Status.FAIL, str(outs[_VIOLATION]))
        if _SKIPPED in outs:
            return StageFailure(Status.SKIP, str(outs[_SKIPPED]))
        return None

    def __getitem__(self, stage: str) -> dict[str, object]:
        try:
            return self._stages[stage]
        except KeyError:
            raise KeyError(
                f"trace of {self.backend!r} (rank {self.rank}) has no stage {stage!r}; "
                f"it has {list(self._stages)}"
            ) from None

    def __contains__(self, stage: object) -> bool:
        return stage in self._stages

    def __iter__(self) -> Iterator[str]:
        return iter(self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    def items(self) -> Iterator[tuple[str, dict[str, object]]]:
        return iter(self._stages.items())

    @property
    def stages(self) -> list[str]:
        return list(self._stages)

    def upto(self, stage: str) -> Trace:
        """A copy holding only the stages before `stage` (the `upstream` of that stage)."""
        out = Trace(self.backend, self.rank)
        for name, outs in self._stages.items():
            if name == stage:
                break
            out.add(name, outs)
        return out

    def only(self, stages: Sequence[str]) -> Trace:
        """A copy holding only `stages` (those it has), in trace order."""
        out = Trace(self.backend, self.rank)
        for name, outs in self._stages.items():
            if name in stages:
                out.add(name, outs)
        return out

    def in_slot_order(self, order: torch.Tensor) -> Trace:
        """A copy whose per-slot outputs (`PER_SLOT_OUTPUTS`, [T, k]) are read in `order`:
        out[t, i] = x[t, order[t, i]] (int64 [T, k]); a token's k slots re-listed, nothing else
        touched. Outputs of another shape are left as they are (the comparison names them)."""
        out = Trace(self.backend, self.rank)
        for name, outs in self._stages.items():
            outs = dict(outs)
            for key in PER_SLOT_OUTPUTS.get(name, ()):
                x = outs.get(key)
                if isinstance(x, torch.Tensor) and x.shape == order.shape:
                    outs[key] = x.gather(1, order.to(x.device))
            out.add(name, outs)
        return out

    def __repr__(self) -> str:
        return f"Trace({self.backend!r}, rank={self.rank}, stages={self.stages})"


class StageSkipped(Exception):
    """Raised by a backend for a stage it cannot run here (the reason says why, e.g. SM100 only).

    The comparison reports the stage as skipped with this reason; it is never silently replaced.
    """


class StageViolation(Exception):
    """Raised by a backend (or the harness) when a stage ran but broke the stage contract, e.g. a
    write past the end of its workspace that did not fault: a failed check at that stage
    (`Trace.add_violation`), not an error."""


@runtime_checkable
class Backend(Protocol):
    """What every MoE implementation under test provides (DESIGN.md "Public surface")."""

    name: str

    def run_stage(
        self, stage: str, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> dict[str, object]: ...

    def run(self, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Trace: ...


def run_stages(backend: Backend, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Trace:
    """Chain `backend.run_stage` over the topology's stages (the default `run`)."""
    trace = Trace(backend.name, rank)
    for stage in problem.stages:
        trace.add(stage, backend.run_stage(stage, problem, inputs, trace, rank))
    return trace
