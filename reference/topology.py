"""Each rank's view of a TP or EP layer, and the cross-rank reduce (ref/vllm-deepgemm-path.md §10).

TP splits the intermediate dimension: rank r owns gate rows [r·Ip, (r+1)·Ip), the matching up rows
and the matching columns of w2; the ranks' bf16 partial outputs are summed. EP splits experts:
an expert_map (global -> local id, or -1) tells each rank which slots are its own; every rank
sees every token (or, under ep+ht, only the tokens dispatched to it) and outputs are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_verify.spec import MoEProblem, Placement, QuantizedWeight, TopologyKind


@dataclass(frozen=True)
class RankView:
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


def rank_view(
    problem: MoEProblem, w13: QuantizedWeight, w2: QuantizedWeight, rank: int
) -> RankView:
    """The weights and expert map `rank` holds (w13/w2 are the full post-processed stacks)."""
    topo = problem.topology
    if not 0 <= rank < topo.size:
        raise ValueError(f"rank: expected 0 <= rank < {topo.size} ({topo}), got {rank}")
    device = w13.q.device
    if topo.kind is TopologyKind.TP:
        i, ip = problem.intermediate, problem.intermediate_per_rank
        gate = torch.arange(rank * ip, (rank + 1) * ip, device=device)
        rows = torch.cat([gate, gate + i])
        return RankView(
            rank,
            tuple(range(problem.num_experts)),
            None,
            _rows(w13, rows),
            _cols(w2, rank * ip, (rank + 1) * ip),
            ip,
        )
    hosts = placement(problem)[rank]
    idx = torch.tensor(hosts, dtype=torch.long, device=device)
    return RankView(
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
    shard = i_s // n
    gate = torch.arange(rank * shard, (rank + 1) * shard, device=w13.q.device)
    return _rows(w13, torch.cat([gate, gate + i_s])), _cols(w2, rank * shard, (rank + 1) * shard)


def dispatched_tokens(local_ids: torch.Tensor) -> torch.Tensor:
    """ep+ht: int64 indices of tokens with at least one slot on this rank (DeepEP dispatch)."""
    return (local_ids >= 0).any(dim=1).nonzero().squeeze(1)


def reduce_with_shared(
    routed: list[torch.Tensor],
    shared: list[torch.Tensor],
    num_tokens: int,
    token_index: list[torch.Tensor | None] | None,
    output_is_reduced: bool,
) -> torch.Tensor:
    """The runner's finish (vLLM MoERunner, ref §10.6): routed + shared, then the final reduce.

    When the prepare/finalize already reduced the routed output (DeepEP HT/LL combine), the shared
    partials are all-reduced on their own and added; otherwise each rank adds its shared partial
    to its routed partial in bf16 and the sums are all-reduced.
    """
    if output_is_reduced:
        combined = reduce_partials(routed, num_tokens, token_index)
        shared_sum = reduce_partials(shared, num_tokens)
        return (combined.float() + shared_sum.float()).to(torch.bfloat16)
    finals = [
        (r.float() + s.float()).to(torch.bfloat16) for r, s in zip(routed, shared, strict=True)
    ]
    return reduce_partials(finals, num_tokens)


def reduce_partials(
    partials: list[torch.Tensor],
    num_tokens: int,
    token_index: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Sum the ranks' bf16 outputs in fp32 and round once (all-reduce / HT combine).

    With token_index (ep+ht), rank r's row j belongs to token token_index[r][j].
    """
    hidden = partials[0].shape[1]
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=partials[0].device)
    for r, part in enumerate(partials):
        idx = token_index[r] if token_index is not None else None
        if idx is None:
            acc += part.float()
        else:
            acc.index_add_(0, idx, part.float())
    return acc.to(torch.bfloat16)
