"""The optimized side's own rank views: expert maps and weight shards, as vLLM builds them.

Written independently of reference/topology.py on purpose: a misrouting bug in either one (the
remainder-to-first-ranks rule, round-robin, replica tables) shows up as a disagreement.
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    MoEInputs,
    MoEProblem,
    Placement,
    QuantizedWeight,
    RankShard,
    TopologyKind,
)

# One rank's weights and id map (the vocabulary's type: the stage context hands it in).
Shard = RankShard


def hosted_experts(problem: MoEProblem, rank: int) -> list[int]:
    """Logical experts on `rank` (vLLM determine_expert_map; remainder to the first ranks)."""
    topo, num = problem.topology, problem.num_experts
    if topo.kind is TopologyKind.TP:
        return list(range(num))
    if topo.placement is Placement.EXPLICIT:
        assert topo.explicit is not None
        return list(topo.explicit[rank])
    if topo.placement is Placement.ROUND_ROBIN:
        return [e for e in range(num) if e % topo.size == rank]
    per_rank = num // topo.size
    extra = num % topo.size
    first = rank * per_rank + min(rank, extra)
    count = per_rank + int(rank < extra)
    return list(range(first, first + count))


def build_expert_map(problem: MoEProblem, rank: int, device: torch.device) -> torch.Tensor | None:
    topo = problem.topology
    if topo.kind is TopologyKind.TP:
        return None
    if topo.placement is Placement.EXPLICIT:
        assert topo.explicit is not None
        sizes = [len(r) for r in topo.explicit]
        table = torch.full((sum(sizes),), -1, dtype=torch.int32)
        begin = sum(sizes[:rank])
        table[begin : begin + sizes[rank]] = torch.arange(sizes[rank], dtype=torch.int32)
        return table.to(device)
    table = torch.full((problem.num_experts,), -1, dtype=torch.int32)
    for local, expert in enumerate(hosted_experts(problem, rank)):
        table[expert] = local
    return table.to(device)


def replica_table(problem: MoEProblem, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """EPLB tables: [E, max_replicas] physical ids of each logical expert, and replica counts."""
    topo = problem.topology
    assert topo.explicit is not None
    physical: list[list[int]] = [[] for _ in range(problem.num_experts)]
    pid = 0
    for rank_experts in topo.explicit:
        for expert in rank_experts:
            physical[expert].append(pid)
            pid += 1
    width = max(len(p) for p in physical)
    padded = [p + [p[0]] * (width - len(p)) for p in physical]
    counts = [len(p) for p in physical]
    return (
        torch.tensor(padded, dtype=torch.long, device=device),
        torch.tensor(counts, dtype=torch.long, device=device),
    )


def shard(problem: MoEProblem, w13: QuantizedWeight, w2: QuantizedWeight, rank: int) -> Shard:
    topo = problem.topology
    if not 0 <= rank < topo.size:
        raise ValueError(f"rank: expected 0 <= rank < {topo.size} for {topo}, got {rank}")
    device = w13.q.device
    if topo.kind is TopologyKind.TP:
        return Shard(
            tuple(range(problem.num_experts)),
            None,
            tp_gate_up_shard(w13, problem.intermediate, problem.intermediate_per_rank, rank),
            tp_down_shard(w2, problem.intermediate_per_rank, rank),
        )
    experts = hosted_experts(problem, rank)
    return Shard(
        tuple(experts),
        build_expert_map(problem, rank, device),
        w13.select(experts),
        w2.select(experts),
    )


class ShardCache:
    """Each rank's shard of one inputs object, built once and kept for every stage and mode
    (the inputs object is held, so a new one can never alias a stale entry through its id)."""

    def __init__(self) -> None:
        self._inputs: MoEInputs | None = None
        self._shards: dict[tuple[MoEProblem, int], Shard] = {}

    def get(self, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Shard:
        if inputs is not self._inputs:
            self._inputs, self._shards = inputs, {}
        key = (problem, rank)
        if key not in self._shards:
            self._shards[key] = shard(problem, inputs.w13_q, inputs.w2_q, rank)
        return self._shards[key]

    def __call__(self, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Shard:
        """A StageContext's `shard_of`: `rank`'s shard of `inputs`, built once."""
        return self.get(problem, inputs, rank)


def tp_gate_up_shard(w: QuantizedWeight, inter: int, per_rank: int, rank: int) -> QuantizedWeight:
    """Rank's gate rows and the matching up rows, concatenated (gate first, as in the kernel)."""
    block_rows = w.block[0]
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    q = torch.cat([w.q[:, lo:hi], w.q[:, inter + lo : inter + hi]], dim=1)
    s_lo, s_hi, s_off = lo // block_rows, hi // block_rows, inter // block_rows
    s = torch.cat([w.scale[:, s_lo:s_hi], w.scale[:, s_off + s_lo : s_off + s_hi]], dim=1)
    return QuantizedWeight(q.contiguous(), s.contiguous(), w.block)


def tp_down_shard(w: QuantizedWeight, per_rank: int, rank: int) -> QuantizedWeight:
    """Rank's slice of w2's reduction (K) columns; FP4 packs two columns per byte."""
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    div = 2 if w.fp4 else 1
    q = w.q[:, :, lo // div : hi // div]
    s = w.scale[:, :, lo // w.block[1] : hi // w.block[1]]
    return QuantizedWeight(q.contiguous(), s.contiguous(), w.block)
