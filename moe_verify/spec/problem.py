"""The problem: one MoE layer to verify, its fields checked alone and together, its JSON form."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_verify.spec.activation import Activation
from moe_verify.spec.arith import round_up
from moe_verify.spec.checks import (
    ALIGNMENT_STEP,
    MAX_ALIGNMENT,
    MAX_EXPERTS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_SEED,
    MAX_SHARED_EXPERTS,
    MAX_TOKENS,
    _got,
    check_bool,
    check_enum,
    check_float,
    check_int,
    exact_keys,
)
from moe_verify.spec.recipes import LL_BLOCK_ROWS, GroupedLayout, Recipe, ScaleFmt
from moe_verify.spec.routing import Routing, check_routing
from moe_verify.spec.stages import BATCHED_STAGES, STAGES, RouterWeight, Stage
from moe_verify.spec.topology import Placement, Topology, TopologyKind, explicit_lists


def _size(arg: str, value: object, high: int) -> int:
    """A size of the layer: an int in [1, high]. Zero is refused by name: a layer without tokens,
    experts or columns runs every stage on empty tensors and passes, having verified nothing."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == 0:
        raise ValueError(
            f"{arg}: expected an int in [1, {high}], got 0 (an empty problem: nothing to verify)"
        )
    return check_int(arg, value, 1, high)


@dataclass(frozen=True)
class MoEProblem:
    """One MoE layer to verify: shapes, recipe, routing, topology and seed.

    `alignment` is the per-expert row padding A of the contiguous layout (DeepGEMM's BLOCK_M);
    `provenance` replaces random values with tagged ones that survive quantization, so a wrong
    row names the token and expert it came from. `grouped_layout` "masked" runs the batched
    layout (`dispatch`) in any topology, as ep:N+ll always does; `ll_capacity` sizes its batches
    (`ll_max_tokens`); `tiny_tokens` makes the first tokens tiny enough that every MXFP8
    group of them gets E8M0 byte 0 (moe_verify/run/inputs.py). `router_weight` says where the
    top-k weight is applied: the gather's sum, or the input before quantization (top-1 only;
    docs/stage-contract.md#router-weight).
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
    router_weight: RouterWeight = RouterWeight.GATHER  # where the top-k weight is applied

    def __post_init__(self) -> None:
        # Enum fields also take their exact strings (CLI, JSON round trips).
        for name, typ in (
            ("recipe", Recipe),
            ("scale_fmt", ScaleFmt),
            ("routing", Routing),
            ("grouped_layout", GroupedLayout),
            ("router_weight", RouterWeight),
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

        put("tokens", _size("MoEProblem.tokens", self.tokens, MAX_TOKENS))
        put("hidden", _size("MoEProblem.hidden", self.hidden, MAX_HIDDEN))
        put("intermediate", _size("MoEProblem.intermediate", self.intermediate, MAX_INTERMEDIATE))
        put("num_experts", _size("MoEProblem.num_experts", self.num_experts, MAX_EXPERTS))
        put("topk", _size("MoEProblem.topk", self.topk, MAX_EXPERTS))
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
        check_routing(
            self.routing,
            num_experts=self.num_experts,
            topk=self.topk,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            renormalize=self.renormalize,
        )
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
        ll = self.topology.kind is TopologyKind.EP_LL
        need(
            not ll or self.grouped_layout in (GroupedLayout.AUTO, GroupedLayout.MASKED),
            f"grouped_layout: ep+ll dispatches each expert's rows into a batch of its own (the "
            f"masked layout), got grouped_layout={self.grouped_layout}",
        )
        if self.batched:
            # DeepGEMM's masked FP8 GEMM: fp8_block, scales per 128 (fp32, or UE8M0 packed).
            need(
                self.recipe is Recipe.FP8_BLOCK,
                f"the masked layout ({self.layout_name}) supports recipe fp8_block, got recipe "
                f"{self.recipe}",
            )
        if ll:
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
        if self.router_weight is RouterWeight.INPUT:
            self._validate_router_weight()
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

    def _validate_router_weight(self) -> None:
        """The weight on the input (docs/stage-contract.md#router-weight): one weight per token
        (top-1, as vLLM asserts), not 1 by construction (else there is nothing to verify), and
        no provenance tags (the weight would rescale them)."""
        what = "MoEProblem.router_weight: 'input' (the weight multiplied into the input)"
        if self.topk != 1:
            raise ValueError(
                f"{what} is defined for topk=1 only: a token's one input row cannot carry "
                f"{self.topk} weights (vLLM asserts the same); got topk={self.topk}"
            )
        if self.renormalize and self.routed_scaling_factor == 1.0:
            raise ValueError(
                f"{what} with topk=1 and renormalize=True gives every token the weight 1.0 "
                f"(routing {self.routing.value!r}), so where it is applied changes nothing: turn "
                "renormalization off (MoEProblem.renormalize) with a router-driven routing "
                "(softmax, skew, empty_*, grouped)"
            )
        if self.provenance:
            raise ValueError(f"{what} with provenance: the weight would rescale the tags")

    def _validate_ll_capacity(self) -> None:
        """A given batch capacity: the masked layout only, whole 128-row blocks, room for every
        token."""
        cap, least = self.ll_capacity, round_up(self.tokens, LL_BLOCK_ROWS)
        if not self.batched:
            raise ValueError(
                f"MoEProblem.ll_capacity: the batch capacity of the masked layout (ep:N+ll's "
                f"DeepEP max_tokens); {self.layout_name} has no batches, got ll_capacity={cap} "
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

    @property
    def batched(self) -> bool:
        """The masked layout: `dispatch` into per-expert batches instead of align and permute
        (grouped_layout "masked", or ep:N+ll, which always runs it)."""
        return (
            self.grouped_layout is GroupedLayout.MASKED or self.topology.kind is TopologyKind.EP_LL
        )

    @property
    def layout_name(self) -> str:
        """'topology tp2 with grouped_layout masked', 'ep+ll (topology ep2-ll)': what chose the
        layout, for messages."""
        if self.topology.kind is TopologyKind.EP_LL:
            return f"ep+ll (topology {self.topology})"
        if self.grouped_layout is GroupedLayout.AUTO:
            return f"topology {self.topology}"
        return f"topology {self.topology} with grouped_layout {self.grouped_layout}"

    @property
    def stages(self) -> tuple[Stage, ...]:
        """This rank's stages: the layout's, then `shared` when there are shared experts."""
        own = BATCHED_STAGES if self.batched else STAGES
        return own + ((Stage.SHARED,) if self.shared_experts else ())

    @property
    def ll_max_tokens(self) -> int:
        """Rows of each local expert's batch in the masked layout (M_max of the masked GEMM).

        DeepEP sizes its low-latency receive buffers from a configured capacity (vLLM: its DP
        chunk, 256 tokens by default, times the ranks), not from the batch at hand; here the
        tokens rounded up to whole 128-row blocks unless `ll_capacity` gives one (validated: whole
        blocks, at least that). DeepGEMM's masked GEMM needs whole blocks: it views the batches as
        one [E_l * M_max] matrix, so a block running past M_max reads and overwrites the next
        expert's rows (seen on the H200 at M_max = 20, docs/gpu-results.md).
        """
        return self.ll_capacity or round_up(self.tokens, LL_BLOCK_ROWS)

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
        if self.router_weight is RouterWeight.INPUT:
            parts.append("weight_on_input")
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
            "router_weight": self.router_weight.value,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> MoEProblem:
        """The inverse of `to_dict` (a dump's problem.json, --problem-json): every key present,
        no other; the values are checked as the constructor checks them. A key added after
        problems were first written (`_LATER_KEYS`) may be absent: a file without it was written
        when its default was the only behaviour."""
        if isinstance(d, Mapping):
            d = {**{k: v for k, v in _LATER_KEYS.items() if k not in d}, **d}
        d = dict(exact_keys("problem", d, [f.name for f in dataclasses.fields(MoEProblem)]))
        # A hand-written file may also give the topology and activation as strings ('ep:4').
        if not isinstance(d["topology"], str):
            topo = exact_keys("problem['topology']", d["topology"], _TOPOLOGY_KEYS)
            explicit = topo["explicit"]
            d["topology"] = Topology(
                topo["kind"],
                topo["size"],
                topo["placement"],
                None if explicit is None else explicit_lists(explicit),
            )
        if not isinstance(d["activation"], str):
            act = exact_keys("problem['activation']", d["activation"], _ACTIVATION_KEYS)
            d["activation"] = Activation(**act)
        return MoEProblem(**d)


_TOPOLOGY_KEYS = ("kind", "size", "placement", "explicit")
_LATER_KEYS: dict[str, object] = {"ll_capacity": 0, "tiny_tokens": 0, "router_weight": "gather"}
_ACTIVATION_KEYS = tuple(f.name for f in dataclasses.fields(Activation))
