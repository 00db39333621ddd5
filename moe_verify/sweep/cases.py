"""Curated case lists (each row names the edge it exercises; ids come from MoEProblem.id), and
the selection of them a sweep runs (`select_cases`: a filter, a shard)."""

from __future__ import annotations

from typing import Any

from moe_verify.spec import Activation, MoEProblem, Recipe, Routing, ScaleFmt, Topology

P = MoEProblem
SWIGLU = Activation("swigluoai", 1.702, 1.0, 7.0)

# Small shapes that run in seconds on a CPU under the Triton interpreter.
SMOKE_ROWS: list[tuple[MoEProblem, str]] = [
    (P(tokens=16, hidden=256, intermediate=256, num_experts=4, topk=2), "plain fp8_block, fp32"),
    (P(tokens=1, hidden=128, intermediate=128, num_experts=4, topk=2), "T = 1"),
    (
        P(tokens=9, hidden=256, intermediate=128, num_experts=8, topk=8, routing=Routing.UNIFORM),
        "topk == E",
    ),
    (
        P(
            tokens=24,
            hidden=128,
            intermediate=128,
            num_experts=6,
            topk=2,
            routing=Routing.EMPTY_MIDDLE,
            scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0,
        ),
        "empty expert, ceil",
    ),
    (
        P(
            tokens=20,
            hidden=128,
            intermediate=256,
            num_experts=4,
            topk=3,
            routing=Routing.INVALID_SLOTS,
            scale_fmt=ScaleFmt.UE8M0_PACKED,
        ),
        "-1 slots, packed scales",
    ),
    (
        P(
            tokens=12,
            hidden=128,
            intermediate=128,
            num_experts=4,
            topk=2,
            routing=Routing.DUPLICATES,
            alignment=32,
        ),
        "duplicate ids, A < 128",
    ),
    (
        P(
            tokens=16,
            hidden=128,
            intermediate=128,
            num_experts=4,
            topk=2,
            recipe=Recipe.MXFP8,
            scale_fmt=ScaleFmt.UE8M0_PACKED,
        ),
        "MXFP8 1x32",
    ),
    (
        P(
            tokens=16,
            hidden=128,
            intermediate=128,
            num_experts=4,
            topk=2,
            recipe=Recipe.MXFP4_W4A8,
            scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0,
        ),
        "FP4 weights",
    ),
    (
        P(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, activation=SWIGLU),
        "swigluoai with alpha, beta, clamp",
    ),
    (
        P(
            tokens=16,
            hidden=128,
            intermediate=256,
            num_experts=5,
            topk=2,
            topology=Topology.parse("ep:2"),
        ),
        "EP, E not divisible by ranks",
    ),
    (
        P(
            tokens=16,
            hidden=128,
            intermediate=256,
            num_experts=4,
            topk=2,
            topology=Topology.parse("tp:2"),
        ),
        "TP split of I",
    ),
]
SMOKE: list[MoEProblem] = [p for p, _ in SMOKE_ROWS]

# Every topology vLLM runs, on small shapes (CPU-friendly; A=32 as DeepGEMM 2.6.1 picks on SM100
# for small M); each row names its edge.
_T = dict(tokens=16, hidden=128, intermediate=256, num_experts=6, topk=2, alignment=32)
TOPOLOGY_ROWS: list[tuple[MoEProblem, str]] = [
    (P(**_T, topology=Topology.parse("tp:2")), "I split; bf16 partials summed"),
    (
        P(
            **{**_T, "intermediate": 512},
            topology=Topology.parse("tp:4"),
            scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0,
        ),
        "4-way split of I",
    ),
    (P(**{**_T, "intermediate": 1024}, topology=Topology.parse("tp:8")), "8 bf16 partials"),
    (P(**_T, topology=Topology.parse("ep:4")), "E % ranks != 0: remainder to the first ranks"),
    (P(**_T, topology=Topology.parse("ep:4:round_robin")), "expert e on rank e % 4"),
    (P(**_T, topology=Topology.explicit_ep([[0, 1, 2, 3], [3, 4, 5, 0]])), "EPLB replicas"),
    (P(**_T, topology=Topology.parse("ep:2+ht")), "dispatched tokens, exact M_sum, int64 ids"),
    (P(**_T, topology=Topology.parse("ep:2+ll")), "batched [E_l, T, H] + masked GEMMs"),
    (P(**_T, topology=Topology.parse("ep:8")), "more ranks than experts: two own none"),
    (P(**_T, topology=Topology.parse("ep:8+ht")), "ranks that receive zero tokens"),
    (P(**_T, topology=Topology.parse("ep:8+ll")), "empty batches"),
    (P(**_T, topology=Topology.parse("ep:2+ht"), routing=Routing.ONE_EXPERT), "all on one rank"),
    (P(**{**_T, "num_experts": 4}, topology=Topology.parse("ep:4")), "one expert per rank"),
    (
        P(
            **_T,
            topology=Topology.parse("ep:2"),
            recipe=Recipe.MXFP8,
            scale_fmt=ScaleFmt.UE8M0_PACKED,
        ),
        "MX scales x EP (vLLM issue #42118)",
    ),
    (
        P(
            **_T,
            topology=Topology.parse("tp:2"),
            recipe=Recipe.MXFP4_W4A8,
            scale_fmt=ScaleFmt.UE8M0_PACKED,
        ),
        "FP4 weights split along I",
    ),
    (P(**_T, topology=Topology.parse("ep:2"), shared_experts=1), "shared + routed, then reduce"),
    (
        P(**_T, topology=Topology.parse("ep:2+ht"), shared_experts=1),
        "combine reduced: shared apart",
    ),
]
TOPOLOGY: list[MoEProblem] = [p for p, _ in TOPOLOGY_ROWS]

# The GPU pipeline list: the shapes vLLM runs (issue 3), FP8 block through DeepGEMM, both SM90
# formats (tests/gpu/test_sm90_pipeline.py; the nightly preset is moe_verify/sweep/nightly.py).
DSV3_LOCAL: dict[str, Any] = dict(hidden=7168, intermediate=2048, num_experts=32, topk=8)
QWEN3: dict[str, Any] = dict(hidden=4096, intermediate=1536, num_experts=128, topk=8)
# H, I and experts of every GPU-tier problem that is not a model's shape: one shape, so DeepGEMM
# JIT-compiles its GEMMs once for the tier (each new (N, K, experts) is a compile of ~9 s on the
# H200). Multiples of 128 (DeepGEMM's K blocks); 8 experts on one rank, 4 per rank under ep:2
# (16 experts: 8 per rank); I_p = 512, at which vLLM's _valid_deep_gemm prefers Triton unless
# E8M0 is in use.
GPU_SHAPE: dict[str, Any] = dict(hidden=512, intermediate=512, num_experts=8)


def pipeline_rows() -> list[tuple[MoEProblem, str]]:
    """Model shapes end to end on one GPU rank, each with the edge it exercises."""
    rows: list[tuple[MoEProblem, str]] = []
    for fmt in (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0):
        for tokens in (1, 7, 128, 1000, 4096):  # decode .. prefill
            rows.append(
                (
                    P(tokens=tokens, scale_fmt=fmt, **DSV3_LOCAL),
                    f"DeepSeek-V3 EP8-local at T={tokens}, {fmt}",
                )
            )
        rows.append((P(tokens=512, scale_fmt=fmt, **QWEN3), f"Qwen3 shape, {fmt}"))
        rows.append(
            (
                P(tokens=256, topk=4, scale_fmt=fmt, **GPU_SHAPE),
                f"small I (I_p <= 512): Triton by vLLM's _valid_deep_gemm unless E8M0, {fmt}",
            )
        )
        rows.append(
            (
                P(
                    tokens=300,
                    hidden=3584,
                    intermediate=1024,
                    num_experts=32,
                    topk=4,
                    scale_fmt=fmt,
                ),
                "H = 3584: K not a power-of-two number of 128-blocks through DeepGEMM (28), and "
                f"a masked column tail in gather (3.5 tiles of 1024), {fmt}",
            )
        )
    for recipe, fmt in (
        (Recipe.MXFP8, ScaleFmt.UE8M0_PACKED),
        (Recipe.MXFP4_W4A8, ScaleFmt.FLOAT32_CEIL_UE8M0),
    ):
        rows.append(
            (
                P(
                    tokens=512,
                    hidden=4096,
                    intermediate=1536,
                    num_experts=32,
                    topk=8,
                    recipe=recipe,
                    scale_fmt=fmt,
                ),
                f"{recipe}/{fmt}: Triton GEMMs on SM90",
            )
        )
    rows.append(
        (
            P(
                tokens=300,
                hidden=2880,
                intermediate=2880,
                num_experts=32,
                topk=4,
                recipe=Recipe.MXFP8,
                scale_fmt=ScaleFmt.UE8M0_PACKED,
            ),
            "H = 2880 (GPT-OSS), not a multiple of 128: only the 1x32 recipe takes it unpadded; "
            "gather BLOCK_D = 64",
        )
    )
    return rows


def pipeline() -> list[MoEProblem]:
    return [p for p, _ in pipeline_rows()]


def dsv3_ep8_rows() -> list[tuple[MoEProblem, str]]:
    """DeepSeek-V3 at full scale, EP8 emulated on one GPU (E=256 global, k=8, T=4096 global),
    each with the edge it exercises."""
    full = dict(
        tokens=4096,
        hidden=7168,
        intermediate=2048,
        num_experts=256,
        topk=8,
        routing=Routing.GROUPED,
        num_expert_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0,
    )
    return [
        (P(**full, topology=Topology.parse("ep:8")), "ep:8: every rank sees every token"),
        (P(**full, topology=Topology.parse("ep:8+ht")), "ep:8+ht: dispatched tokens, exact M_sum"),
        (
            P(**{**full, "scale_fmt": ScaleFmt.FLOAT32}, topology=Topology.parse("ep:8+ll")),
            "ep:8+ll: the batched masked layout (BatchedDeepGemmExperts: fp32 scales)",
        ),
    ]


def dsv3_ep8() -> list[MoEProblem]:
    return [p for p, _ in dsv3_ep8_rows()]


def nightly() -> list[MoEProblem]:
    """The nightly preset: the covering design of moe_verify/sweep/nightly.py."""
    from moe_verify.sweep.nightly import nightly_cases

    return [c.problem for c in nightly_cases()]


def engine_checks(key: str) -> list[MoEProblem]:
    """The cases `moe-verify engines --run` runs on each release of engine `key`
    (moe_verify/engines/checks.py)."""
    from moe_verify.engines import checks

    return checks.preset(key)


PRESETS = {
    "smoke": lambda: list(SMOKE),
    "topology": lambda: list(TOPOLOGY),
    "nightly": nightly,
    "pipeline": pipeline,
    "dsv3-ep8": dsv3_ep8,
    "engine-vllm": lambda: engine_checks("vllm"),
    "engine-sglang": lambda: engine_checks("sglang"),
    "engine-lmdeploy": lambda: engine_checks("lmdeploy"),
}


def preset(name: str) -> list[MoEProblem]:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]()


def select_cases(
    cases: str | list[MoEProblem], filter_text: str | None = None, shard: str | None = None
) -> list[MoEProblem]:
    """A preset's cases (by name) or the given ones, those whose id contains `filter_text`, then
    the shard 'i/n' of them (case j goes to shard j % n + 1: every shard gets a mix)."""
    name = cases if isinstance(cases, str) else "cases"
    chosen = preset(cases) if isinstance(cases, str) else list(cases)
    chosen = [c for c in chosen if not filter_text or filter_text in c.id]
    if not chosen:
        raise ValueError(f"sweep: no case of {name!r} matches the filter {filter_text!r}")
    if shard is not None:
        from moe_verify.sweep.nightly import shard as take_shard

        chosen = take_shard(chosen, shard)
        if not chosen:
            raise ValueError(f"--shard {shard}: this shard of {name!r} holds no case")
    return chosen


def preset_edges(name: str) -> dict[str, str]:
    """Case id -> the edge it exercises: every preset carries one per case (`sweep --list`
    prints them)."""
    preset(name)  # the same error for an unknown name
    rows = {
        "smoke": lambda: SMOKE_ROWS,
        "topology": lambda: TOPOLOGY_ROWS,
        "pipeline": pipeline_rows,
        "dsv3-ep8": dsv3_ep8_rows,
    }.get(name)
    if rows is not None:
        return {p.id: edge for p, edge in rows()}
    if name.startswith("engine-"):
        from moe_verify.engines import checks

        return checks.edges(name.removeprefix("engine-"))
    from moe_verify.sweep.nightly import nightly_cases

    return {c.problem.id: c.edge for c in nightly_cases()}
