"""The parallel layout of one MoE layer: tensor or expert parallel, ranks, expert placement."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from moe_verify.spec.checks import MAX_EXPERTS, MAX_RANKS, _got, check_enum, check_int


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


def explicit_lists(ranks: object) -> tuple[tuple[int, ...], ...]:
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
            object.__setattr__(self, "explicit", explicit_lists(self.explicit))
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
        lists = explicit_lists(ranks)
        if not 1 <= len(lists) <= MAX_RANKS:
            raise ValueError(
                f"Topology.explicit: expected 1 to {MAX_RANKS} rank lists, got {len(lists)}"
            )
        return Topology(TopologyKind.EP, len(lists), Placement.EXPLICIT, lists)

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
