"""Each rank's shard of a TP or EP layer, and the cross-rank reduce (vLLM 0.32
fused_moe/config.py `FusedMoEParallelConfig` and its expert map).

TP splits the intermediate dimension: rank r owns gate rows [r·Ip, (r+1)·Ip), the matching up rows
and the matching columns of w2; the ranks' bf16 partial outputs are summed. EP splits experts:
an expert_map (global -> local id, or -1) tells each rank which slots are its own; every rank
sees every token (or, under ep+ht, only the tokens dispatched to it) and outputs are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_verify.spec import (
    MoEProblem,
    Placement,
    QuantizedWeight,
    Stage,
    StageSkipped,
    TopologyKind,
    Trace,
)


@dataclass(frozen=True)
class Shard:
    """What one rank holds.

    experts       logical (global) expert of each local expert slot
    expert_map    int32 [E_ids]: id space of topk_ids -> local expert, -1 if remote; None for TP
    w13, w2       this rank's weights: local experts, and for TP the intermediate shard
    """

    rank: int
    experts: tuple[int, ...]
    expert_map: torch.Tensor | None
    w13: QuantizedWeight
    w2: QuantizedWeight
    intermediate: int

    @property
    def num_local_experts(self) -> int:
        return len(self.experts)


def placement(problem: MoEProblem) -> list[list[int]]:
    """Logical experts hosted by each rank, in local-slot order."""
    topo, e = problem.topology, problem.num_experts
    n = topo.size
    if topo.kind is TopologyKind.TP:
        return [list(range(e)) for _ in range(n)]
    if topo.placement is Placement.EXPLICIT:
        return [list(r) for r in topo.explicit or ()]
    if topo.placement is Placement.ROUND_ROBIN:
        return [list(range(r, e, n)) for r in range(n)]
    base, rem = divmod(e, n)  # the remainder goes to the FIRST ranks (vLLM, despite its docstring)
    out = []
    for r in range(n):
        start = r * base + min(r, rem)
        out.append(list(range(start, start + base + (1 if r < rem else 0))))
    return out


def physical_experts(problem: MoEProblem) -> list[int]:
    """Logical expert of each physical expert id (ranks' slots concatenated in rank order).

    Only explicit placement distinguishes physical from logical ids (EPLB replicas); otherwise the
    identity.
    """
    if problem.topology.placement is not Placement.EXPLICIT:
        return list(range(problem.num_experts))
    return [e for r in placement(problem) for e in r]


def logical_to_physical(topk_ids: torch.Tensor, problem: MoEProblem) -> torch.Tensor:
    """EPLB: map each logical id to one of its replicas, chosen by a hash of the token index.

    replica = ((t · 2654435769) mod 2^32) mod replica_count (vLLM's Knuth multiplicative hash).
    -1 stays -1. Identity unless the placement is explicit.
    """
    if problem.topology.placement is not Placement.EXPLICIT:
        return topk_ids
    phys = physical_experts(problem)
    replicas: list[list[int]] = [[] for _ in range(problem.num_experts)]
    for p, e in enumerate(phys):
        replicas[e].append(p)
    width = max(len(r) for r in replicas)
    table = torch.tensor(
        [r + [r[0]] * (width - len(r)) for r in replicas], dtype=torch.long, device=topk_ids.device
    )
    count = torch.tensor([len(r) for r in replicas], dtype=torch.long, device=topk_ids.device)
    t = torch.arange(topk_ids.shape[0], device=topk_ids.device, dtype=torch.long).unsqueeze(1)
    ids = topk_ids.long().clamp(min=0)
    pick = ((t * 2654435769) & 0xFFFFFFFF) % count[ids]
    out = table[ids, pick]
    return torch.where(topk_ids >= 0, out, torch.full_like(out, -1)).to(topk_ids.dtype)


def expert_map(problem: MoEProblem, rank: int, device: torch.device) -> torch.Tensor | None:
    """int32 [E_ids] for EP ranks (None for TP): id -> local slot on `rank`, or -1."""
    if problem.topology.kind is TopologyKind.TP:
        return None
    hosts = placement(problem)
    if problem.topology.placement is Placement.EXPLICIT:
        offset = sum(len(r) for r in hosts[:rank])
        m = torch.full((len(physical_experts(problem)),), -1, dtype=torch.int32, device=device)
        m[offset : offset + len(hosts[rank])] = torch.arange(
            len(hosts[rank]), dtype=torch.int32, device=device
        )
        return m
    m = torch.full((problem.num_experts,), -1, dtype=torch.int32, device=device)
    if hosts[rank]:
        m[torch.tensor(hosts[rank], device=device)] = torch.arange(
            len(hosts[rank]), dtype=torch.int32, device=device
        )
    return m


def _rows(w: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    """Select output rows n of every expert (scales follow their row blocks)."""
    bm = w.block[0]
    scale_rows = rows[::bm] // bm if bm > 1 else rows
    return QuantizedWeight(w.q[:, rows], w.scale[:, scale_rows], w.block)


def _cols(w: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    """Keep K columns [lo, hi) of every expert (FP4 codes are two per byte)."""
    bk = w.block[1]
    q = w.q[:, :, lo // 2 : hi // 2] if w.fp4 else w.q[:, :, lo:hi]
    return QuantizedWeight(q, w.scale[:, :, lo // bk : hi // bk], w.block)


def shard(problem: MoEProblem, w13: QuantizedWeight, w2: QuantizedWeight, rank: int) -> Shard:
    """The weights and expert map `rank` holds (w13/w2 are the full post-processed stacks)."""
    topo = problem.topology
    if not 0 <= rank < topo.size:
        raise ValueError(f"rank: expected 0 <= rank < {topo.size} ({topo}), got {rank}")
    device = w13.q.device
    if topo.kind is TopologyKind.TP:
        i, ip = problem.intermediate, problem.intermediate_per_rank
        gate = torch.arange(rank * ip, (rank + 1) * ip, device=device)
        rows = torch.cat([gate, gate + i])
        return Shard(
            rank,
            tuple(range(problem.num_experts)),
            None,
            _rows(w13, rows),
            _cols(w2, rank * ip, (rank + 1) * ip),
            ip,
        )
    hosts = placement(problem)[rank]
    idx = torch.tensor(hosts, dtype=torch.long, device=device)
    return Shard(
        rank,
        tuple(hosts),
        expert_map(problem, rank, device),
        w13.select(idx),
        w2.select(idx),
        problem.intermediate,
    )


def shared_shard(
    problem: MoEProblem, w13: QuantizedWeight, w2: QuantizedWeight, rank: int
) -> tuple[QuantizedWeight, QuantizedWeight]:
    """Rank's shard of the shared MLP: it is a dense layer, split over every rank (the attention
    TP group) whatever the experts' topology."""
    n, i_s = problem.topology.size, w2.shape[2]
    lo, hi = rank * (i_s // n), (rank + 1) * (i_s // n)
    gate = torch.arange(lo, hi, device=w13.q.device)
    return _rows(w13, torch.cat([gate, gate + i_s])), _cols(w2, lo, hi)


def dispatched_tokens(local_ids: torch.Tensor) -> torch.Tensor:
    """ep+ht: int64 indices of tokens with at least one slot on this rank (DeepEP dispatch)."""
    return (local_ids >= 0).any(dim=1).nonzero().squeeze(1)


# The cross-rank reduce (vLLM MoERunner's finish, one definition for the emulated reduce and the
# real all-reduce): each rank contributes `rank_partial`, the ranks' partials are summed in fp32
# (a sum here, NCCL's all-reduce under torchrun), and `finish` rounds the sums to bf16.

# The stages the reduce reads from each rank's trace.
REDUCE_INPUTS: tuple[Stage, ...] = (Stage.ROUTE, Stage.GATHER, Stage.SHARED)


@dataclass
class Partial:
    """What one rank contributes to the reduce, each fp32 [T, H] in token space.

    routed   the routed output (ep+ht rows scattered to their tokens, zeros elsewhere: the
             combine); with shared experts, and where no combine reduced the routed output,
             routed + shared rounded to bf16 on the rank (vLLM adds them before the all-reduce)
    shared   the shared experts' partial, apart, where DeepEP's combine (ep+ht, ep+ll) already
             reduced the routed output; else None
    """

    routed: torch.Tensor
    shared: torch.Tensor | None = None


def rank_partial(trace: Trace, problem: MoEProblem) -> Partial:
    """Rank's part of the reduce from its trace (fresh tensors: an all-reduce may write them).

    Raises StageSkipped naming what is missing or misshaped, so every rank sums the same [T, H]
    or none does.
    """
    if trace.failure(Stage.GATHER):
        raise StageSkipped(f"gather did not run on rank {trace.rank}")
    out = trace[Stage.GATHER]["out"]
    index = trace[Stage.ROUTE].get("token_index") if Stage.ROUTE in trace else None
    rows = problem.tokens if index is None else index.shape[0]
    if tuple(out.shape) != (rows, problem.hidden):
        raise StageSkipped(
            f"gather out of rank {trace.rank} is {tuple(out.shape)}, not ({rows}, {problem.hidden})"
        )
    routed = torch.zeros(problem.tokens, out.shape[1], dtype=torch.float32, device=out.device)
    if index is None:
        routed += out.float()
    else:
        routed.index_add_(0, index, out.float())
    if not problem.shared_experts:
        return Partial(routed)
    if trace.failure(Stage.SHARED):
        raise StageSkipped(f"shared did not run on rank {trace.rank}")
    shared = trace[Stage.SHARED]["out"]
    if tuple(shared.shape) != (problem.tokens, problem.hidden):
        raise StageSkipped(
            f"shared out of rank {trace.rank} is {tuple(shared.shape)}, not "
            f"({problem.tokens}, {problem.hidden})"
        )
    if problem.topology.kind in (TopologyKind.EP_HT, TopologyKind.EP_LL):
        return Partial(routed, shared.float())
    return Partial((routed + shared.float()).to(torch.bfloat16).float())


def finish(routed_sum: torch.Tensor, shared_sum: torch.Tensor | None) -> torch.Tensor:
    """bf16 [T, H] from the summed fp32 partials: rounded once, plus the shared experts' sum
    (rounded on its own) where the combine had reduced the routed output."""
    out = routed_sum.to(torch.bfloat16)
    if shared_sum is None:
        return out
    return (out.float() + shared_sum.to(torch.bfloat16).float()).to(torch.bfloat16)


def reduce_ranks(traces: list[Trace], problem: MoEProblem) -> torch.Tensor:
    """The `reduce` stage emulated in one process: every rank's partial summed in rank order."""
    partials = [rank_partial(t, problem) for t in traces]
    routed, shared = partials[0].routed, partials[0].shared
    for p in partials[1:]:
        routed = routed + p.routed
        if shared is not None and p.shared is not None:
            shared = shared + p.shared
    return finish(routed, shared)
