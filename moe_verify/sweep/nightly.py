"""The nightly preset: a covering design over the axes a fused-MoE bug hides behind.

A full product of the axes (6 recipe/format pairs x 16 topologies x 10 routings x 6 model
families x 6 token counts) is about 35,000 cases. The design below covers every *pair* instead:

- every (recipe/format, topology) pair the recipe allows, each with a routing, a model family
  and a token count that rotate, so the pairs (topology, routing), (topology, T) and
  (routing, recipe) come out covered too (the `_rotate` rule: the i-th row of a block takes the
  i-th entry of each rotating axis, with coprime axis lengths, so no two axes lock together);
- every routing on every topology family (TP, EP, EP+HT, EP+LL, EPLB, shared experts) once;
- every model family at its full per-rank size on one rank, at decode and prefill sizes;
- the token edges (T = 1, odd, T*k not a power of two, T below the alignment, 4096).

Each row carries the edge it exercises (`NightlyCase.edge`), which `moe-verify sweep --list`
prints. Model families keep their expert count, top-k, activation and H/I ratio; most rows scale
H and I down to a few shapes so the distinct DeepGEMM GEMM shapes (each a JIT compile) stay few:
`gemm_shapes` counts them. The full-size rows are the last block.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from moe_verify.spec import Activation, MoEProblem, Recipe, Routing, ScaleFmt, Topology, ceil_div

SWIGLU_CLAMP = Activation("swigluoai", 1.702, 1.0, 7.0)  # gpt-oss: swigluoai with a clamp


@dataclass(frozen=True)
class NightlyCase:
    problem: MoEProblem
    edge: str  # the edge this row exercises, as the sweep's --list prints it


@dataclass(frozen=True)
class Family:
    """A model family: what its MoE layer is made of, at a reduced and at its full size."""

    name: str
    num_experts: int
    topk: int
    small: tuple[int, int]  # (H, I) used by most rows
    full: tuple[int, int]  # (H, I) of the real model (per rank for EP-local)
    activation: Activation = Activation()
    recipes: tuple[Recipe, ...] = (Recipe.FP8_BLOCK, Recipe.MXFP8, Recipe.MXFP4_W4A8)
    grouped: bool = False  # DeepSeek-style grouped routing
    # Experts one rank holds at full size, where the real model runs expert-parallel and its
    # name's count is global (None: num_experts, the rank holds them all).
    full_experts: int | None = None


FAMILIES = (
    # DeepSeek-V3 EP8-local: 32 of 256 experts, top-8, grouped sigmoid routing.
    Family("dsv3", 32, 8, (1024, 512), (7168, 2048), grouped=True),
    Family("qwen3", 128, 8, (1024, 384), (4096, 1536)),  # Qwen3-MoE: many small experts
    # Kimi-K2-like: E = 384; at full size EP8-local, 48 of them per rank (all 384 at H = 7168 on
    # one rank were 96-114 GiB of weights and fp32 golden: out of the H200's memory).
    Family("kimi", 384, 8, (1024, 256), (7168, 2048), full_experts=48),
    # gpt-oss-like: H = 2880 (22.5 x 128), so only the 1x32 recipe takes it unpadded.
    Family("gptoss", 32, 4, (2880, 2880), (2880, 2880), SWIGLU_CLAMP, (Recipe.MXFP8,)),
    Family("mixtral", 8, 2, (1024, 2048), (4096, 14336)),  # Mixtral-like: E = 8, k = 2, large I
    # (its small I = 2048 is the one family size that splits 8 ways in 128-wide blocks: tp:8)
)
FAMILY = {f.name: f for f in FAMILIES}
# The families the topology blocks rotate through: each topology x family pair is a new set of
# per-rank GEMM shapes (a JIT compile each), so the rest meet the topologies only at tp:1.
TOPOLOGY_FAMILIES = (FAMILY["dsv3"], FAMILY["mixtral"], FAMILY["gptoss"])

RECIPE_FORMATS = (
    (Recipe.FP8_BLOCK, ScaleFmt.FLOAT32),  # SM90 default
    (Recipe.FP8_BLOCK, ScaleFmt.FLOAT32_CEIL_UE8M0),  # SM90 E8M0 (fp32 powers of two)
    (Recipe.FP8_BLOCK, ScaleFmt.UE8M0_PACKED),  # SM100 packed exponents
    (Recipe.MXFP8, ScaleFmt.UE8M0_PACKED),  # 1x32 MX
    (Recipe.MXFP4_W4A8, ScaleFmt.FLOAT32_CEIL_UE8M0),  # FP4 weights, SM90-style scales
    (Recipe.MXFP4_W4A8, ScaleFmt.UE8M0_PACKED),  # FP4 weights, packed
)

TOPOLOGIES = (
    ("tp:1", "one rank"),
    ("tp:2", "I split over 2"),
    ("tp:4", "I split over 4"),
    ("tp:8", "I split over 8"),
    ("ep:2", "experts over 2 ranks"),
    ("ep:4", "E % ranks != 0 for some families: remainder to the first ranks"),
    ("ep:8", "8 ranks: DeepSeek-V3's EP8"),
    ("ep:4:round_robin", "expert e on rank e % 4"),
    ("eplb", "explicit placement with redundant replicas (EPLB)"),
    ("ep:2+ht", "DeepEP HT: dispatched tokens, exact M_sum"),
    ("ep:4+ht", "HT on 4 ranks: ranks may receive no token"),
    ("ep:8+ht", "HT on 8 ranks"),
    ("ep:2+ll", "DeepEP LL: batched layout, masked GEMM"),
    ("ep:4+ll", "LL on 4 ranks: empty batches"),
    ("ep:8+ll", "LL on 8 ranks"),
    ("shared", "a shared expert beside the routed ones (ep:2), then the reduce"),
)

ROUTINGS = (
    (Routing.SOFTMAX, "softmax top-k"),
    (Routing.GROUPED, "DeepSeek grouped sigmoid + bias"),
    (Routing.SKEW, "a hot expert takes half the slots"),
    (Routing.EMPTY_FIRST, "expert 0 empty"),
    (Routing.EMPTY_MIDDLE, "a middle expert empty"),
    (Routing.EMPTY_LAST, "the last expert empty"),
    (Routing.ONE_EXPERT, "every token on one expert"),
    (Routing.INVALID_SLOTS, "-1 slots"),
    (Routing.DUPLICATES, "duplicate ids in a token"),
)

# Token counts: 1 (decode), 7 (odd, T < alignment), 33 (odd, T*k not a power of two), 96 (T*k
# not a power of two, below 128), 200, 512.
TOKENS = (1, 7, 33, 96, 200, 512)


def _topology(name: str, family: Family) -> tuple[Topology, int]:
    """The topology of `name` for `family`, and its shared experts."""
    if name == "shared":
        return Topology.parse("ep:2"), 1
    if name == "eplb":
        e = family.num_experts
        half = e // 2
        # Two ranks; each hosts its half plus a replica of the other half's first expert.
        return Topology.explicit_ep([[*range(half), half], [*range(half, e), 0]]), 0
    return Topology.parse(name), 0


def _legal(recipe: Recipe, fmt: ScaleFmt, topology: str, family: Family) -> bool:
    if recipe not in family.recipes:
        return False
    if "+ll" in topology and (recipe is not Recipe.FP8_BLOCK or fmt is ScaleFmt.UE8M0_PACKED):
        return False  # the batched masked layout runs fp8_block with fp32-stored scales only
    return True


def _problem(
    family: Family,
    recipe: Recipe,
    fmt: ScaleFmt,
    topology: str,
    routing: Routing,
    tokens: int,
    seed: int,
    size: tuple[int, int] | None = None,
    num_experts: int | None = None,
) -> MoEProblem | None:
    """The problem, or None where MoEProblem refuses the combination (e.g. I per rank not a
    multiple of the recipe's block)."""
    topo, shared = _topology(topology, family)
    h, i = size if size is not None else family.small
    experts = num_experts or family.num_experts
    grouped = routing is Routing.GROUPED and experts % 8 == 0
    try:
        return MoEProblem(
            tokens=tokens,
            hidden=h,
            intermediate=i,
            num_experts=experts,
            topk=family.topk,
            recipe=recipe,
            scale_fmt=fmt,
            activation=family.activation,
            routing=routing,
            topology=topo,
            seed=seed,
            shared_experts=shared,
            num_expert_group=8 if grouped else 1,
            topk_group=4 if grouped else 1,
        )
    except ValueError:
        return None


def _rotate(i: int, axis: tuple) -> object:
    return axis[i % len(axis)]


def _pairs_recipe_topology() -> Iterator[NightlyCase]:
    """Every (recipe/format, topology) pair a family allows; routing, family and T rotate."""
    i = 0
    for recipe, fmt in RECIPE_FORMATS:
        for topology, why in TOPOLOGIES:
            families = [f for f in TOPOLOGY_FAMILIES if _legal(recipe, fmt, topology, f)]
            for attempt in range(len(TOPOLOGY_FAMILIES) * len(ROUTINGS)):
                family = families[(i + attempt) % len(families)] if families else None
                routing, rwhy = _rotate(i + attempt, ROUTINGS)
                tokens = _rotate(i + 2 * attempt, TOKENS)
                if family is None:
                    break
                p = _problem(family, recipe, fmt, topology, routing, tokens, seed=i)
                if p is not None:
                    yield NightlyCase(p, f"{recipe}/{fmt} x {topology} ({why}); {rwhy}")
                    break
            i += 1


def _pairs_topology_routing() -> Iterator[NightlyCase]:
    """Every routing on every topology, fp8_block; formats, families and T rotate."""
    i = 0
    sm90 = (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
    for topology, why in TOPOLOGIES:
        for routing, rwhy in ROUTINGS:
            for attempt in range(len(TOPOLOGY_FAMILIES)):
                family = _rotate(i + attempt, TOPOLOGY_FAMILIES)
                fmt = _rotate(i, sm90)
                tokens = _rotate(i + attempt, TOKENS)
                p = _problem(family, Recipe.FP8_BLOCK, fmt, topology, routing, tokens, seed=i)
                if p is not None:
                    yield NightlyCase(p, f"{rwhy} x {topology} ({why})")
                    break
            i += 1


def _token_edges() -> Iterator[NightlyCase]:
    """The token edges on every family and recipe it takes, one rank: T = 1, 7 (odd, below the
    alignment), 33 (T*k not a power of two) and 4096 (prefill)."""
    for i, family in enumerate(FAMILIES):
        routing = Routing.GROUPED if family.grouped else Routing.SOFTMAX
        for j, (recipe, fmt) in enumerate(RECIPE_FORMATS):
            if recipe not in family.recipes:
                continue
            for tokens in (1, 7, 33, 4096):
                p = _problem(family, recipe, fmt, "tp:1", routing, tokens, seed=100 * i + j)
                if p is not None:
                    yield NightlyCase(p, f"{family.name} T={tokens} ({recipe}/{fmt})")


def _full_size() -> Iterator[NightlyCase]:
    """Each family at its real per-rank size (its experts too, where it runs expert-parallel),
    decode and prefill, the SM90 formats."""
    for family in FAMILIES:
        recipe = family.recipes[0]
        fmts = (
            (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
            if recipe is Recipe.FP8_BLOCK
            else (ScaleFmt.UE8M0_PACKED,)
        )
        for fmt in fmts:
            for tokens in (1, 128, 4096 if family.name == "dsv3" else 1024):
                routing = Routing.GROUPED if family.grouped else Routing.SOFTMAX
                p = _problem(
                    family,
                    recipe,
                    fmt,
                    "tp:1",
                    routing,
                    tokens,
                    seed=tokens,
                    size=family.full,
                    num_experts=family.full_experts,
                )
                if p is not None:
                    local = f" ({p.num_experts} local experts)" if family.full_experts else ""
                    yield NightlyCase(p, f"{family.name} at full size{local}, T={tokens}, {fmt}")


def nightly_cases() -> list[NightlyCase]:
    """The nightly preset, each case once (by id), in a stable order."""
    seen: dict[str, NightlyCase] = {}
    for block in (_pairs_recipe_topology, _pairs_topology_routing, _token_edges, _full_size):
        for case in block():
            seen.setdefault(case.problem.id, case)
    return list(seen.values())


def gemm_shapes(problems: list[MoEProblem]) -> set[tuple[int, int, int]]:
    """The distinct (N, K, local experts) of every rank's two grouped GEMMs of the fp8_block
    cases, the ones DeepGEMM runs on SM90: each is one JIT compile per kernel kind (the masked
    GEMM of ep:N+ll counts apart). The MX recipes run the Triton engine there."""
    from moe_verify.spec import TopologyKind

    shapes = set()
    for p in problems:
        if p.recipe is not Recipe.FP8_BLOCK:
            continue
        size = p.topology.size
        tp = p.topology.kind is TopologyKind.TP
        local = p.num_experts if tp else ceil_div(p.num_experts, size)
        if p.topology.explicit is not None:
            local = max(len(r) for r in p.topology.explicit)
        i = p.intermediate_per_rank
        shapes.add((2 * i, p.hidden, local))
        shapes.add((p.hidden, i, local))
    return shapes


def shard(cases: list, spec: str) -> list:
    """The i-th of n interleaved shards of `cases` (spec 'i/n', 1 <= i <= n): case j goes to
    shard j % n + 1, so every shard gets a mix of sizes."""
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected i/n such as 2/4, got {spec!r}") from None
    if not 1 <= index <= count:
        raise ValueError(f"--shard: i must be in 1..n, got {spec!r}")
    return [c for j, c in enumerate(cases) if j % count == index - 1]
