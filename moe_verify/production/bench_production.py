"""`moe-verify bench --production`: the production forward timed as vLLM runs it, beside what
bounds it: DeepGEMM's GEMMs alone on the same operands and the byte floor of the memory stages.

Issue #13's targets on the H200, the byte floor and the rows that judge a stage against them are
in `moe_verify.production.targets`; the tables in `moe_verify.production.report`. This module
measures. All numbers of one table come from one process, side by side:

- production stages: a forward with taps gives each stage its inputs; each stage method of the
  backend (`OptimizedBackend`, run as production mode runs it: graph-safe) is then captured
  alone in its own CUDA graph (after a warm-up call, `CALLS_PER_GRAPH` calls back to back) and
  timed by replaying it (CUDA events, median of repeats, divided by the calls). No validation:
  production mode has none.
- the whole forward: the op (`torch.ops.moe_verify.fused_moe`) captured once and replayed.
- DeepGEMM alone: deep_gemm's grouped GEMM called directly on the very tensors the production
  GEMM stage read and wrote (permuted operands, grouped-layout tensor, output buffer), captured
  and replayed the same way, so the ratio is the cost of everything around DeepGEMM's kernel.
- the byte floor: `floor_bytes` of each memory-bound stage at the copy bandwidth measured in the
  same run (`bench.copy_bandwidth`, a 1 GiB copy: it does not fit in L2).
- launches: the GPU's kernel events of one eager forward (torch.profiler).
- verification mode: `OptimizedBackend` eager, with its host validation, per stage, apart.

Replaying one stage keeps its inputs in L2 where they fit, as a real layer's neighbours would
not; DeepGEMM alone runs under the same condition, so that ratio is fair, and the floor's
bandwidth is a DRAM figure, so a memory stage small enough to live in L2 can exceed 100% of it.

The exact-count path (ep:N+ht) reads the counts on the host and cannot be captured: it is timed
eagerly on the GPU and says so. Without a GPU everything is eager (perf_counter), the tables say
"eager (no CUDA graphs on this machine)", and no target is judged: those numbers are the
tool's plumbing, not performance.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch

from moe_verify.common import progress
from moe_verify.common.device import default_device
from moe_verify.common.timing import median_seconds, replay_seconds
from moe_verify.production.bench import copy_bandwidth
from moe_verify.production.host_reads import HostReads
from moe_verify.production.report import DecodeBench, Environment, ProductionBench, VerificationRow
from moe_verify.production.targets import (
    CALLS_PER_GRAPH,
    CPU_TIMING,
    DECODE_TOKENS,
    FLOORED_STAGES,
    GEMM_STAGES,
    GRAPH_TIMING,
    HT_TIMING,
    NO_TARGET,
    StageRow,
    floor_bytes,
    gemm_row,
    memory_row,
    traffic_of,
)
from moe_verify.run.inputs import make_inputs
from moe_verify.spec import (
    MAX_TOKENS,
    Engine,
    GroupedLayout,
    MoEInputs,
    MoEProblem,
    Stage,
    StageContext,
    Trace,
    call_stage,
    check_int,
    run_stages,
)
from optimized import deepgemm, op, production
from optimized.production import (
    BATCHED,
    CarvedBuffers,
    ForwardConfig,
    RankWeights,
    Taps,
    forward_stages,
    prepare_rank_weights,
    production_context,
    rank_inputs,
    rank_shard,
    workspace_bytes,
    workspace_layout,
)
from optimized.topology import ShardCache
from reference.moe import ReferenceBackend


def _time(fn: Callable[[], object], capture: bool, device: torch.device, repeats: int) -> float:
    """Median seconds of one call of `fn`: replays of its graph (divided by the calls captured
    in it) when `capture`, else eager calls."""
    if not capture:
        return median_seconds(fn, repeats)
    return replay_seconds(fn, device, repeats, CALLS_PER_GRAPH)


def _deepgemm_alone(
    cfg: ForwardConfig, stage: Stage, taps: Taps, w: RankWeights
) -> Callable[[], None]:
    """deep_gemm's own grouped GEMM on the tensors the production `stage` read and wrote.

    The arguments are those `optimized.deepgemm.m_grouped_gemm(_masked)` passes, minus the
    wrapper: no host checks, and no device-side layout copy of the scales (SM100 psum), which
    belongs to the stage's cost, not the kernel's.
    """
    dg = deepgemm.module()
    weight, w_scale = (w.w13, w.w13_scale) if stage is Stage.GEMM1 else (w.w2, w.w2_scale)
    if stage is Stage.GEMM1 and cfg.layout == BATCHED:
        d = taps[Stage.DISPATCH.value]
        a, a_scale = d["a_batched"], d["a_scale_batched"]
        out = taps[Stage.GEMM1.value]["mm1"]
    elif stage is Stage.GEMM1:
        perm = taps[Stage.PERMUTE.value]
        a, a_scale = perm["a_perm"], perm["a_scale_perm"]
        out = taps[Stage.GEMM1.value]["mm1"]
    else:
        a, a_scale = taps[Stage.ACT_QUANT.value]["a2q"], taps[Stage.ACT_QUANT.value]["a2q_scale"]
        out = taps[Stage.GEMM2.value]["mm2"]
    disable_cast = not cfg.scale_fmt.is_ue8m0
    if cfg.layout == BATCHED:
        d = taps[Stage.DISPATCH.value]
        masked_m, expected_m = d["masked_m"], int(d["expected_m"])

        def masked() -> None:
            dg.m_grouped_fp8_gemm_nt_masked(
                (a, a_scale), (weight.q, w_scale), out, masked_m, expected_m,
                disable_ue8m0_cast=disable_cast,
            )  # fmt: skip

        return masked
    psum = cfg.layout == GroupedLayout.PSUM.value
    grouped = taps[Stage.PERMUTE.value]["expert_ends" if psum else "m_indices"]
    kwargs: dict[str, object] = {"disable_ue8m0_cast": disable_cast}
    kwargs.update(deepgemm.scale_group_recipes(cfg.recipe.act_group, weight))
    if psum:
        kwargs["use_psum_layout"] = True
        a_scale = deepgemm.psum_activation_scales(a_scale)
    gemm = (
        dg.m_grouped_fp8_fp4_gemm_nt_contiguous
        if weight.fp4
        else dg.m_grouped_fp8_gemm_nt_contiguous
    )
    b = weight.q.view(torch.int8) if weight.fp4 else weight.q

    def contiguous() -> None:
        with deepgemm.alignment_scope(cfg.alignment):
            gemm((a, a_scale), (b, w_scale), out, grouped, **kwargs)

    return contiguous


def _deepgemm_absent(
    cfg: ForwardConfig, problem: MoEProblem, engine: Engine, device: torch.device
) -> str:
    """Why DeepGEMM alone cannot be timed beside this forward ("" when it can)."""
    status = deepgemm.probe()
    if device.type != "cuda" or not status.usable:
        return status.reason
    if cfg.engine is not Engine.DEEPGEMM:
        why = deepgemm.choose_engine(problem, problem.tokens, engine).reason
        return (
            f"the production GEMMs run on {cfg.engine.value} ({why}); engine deepgemm puts "
            "DeepGEMM under them"
        )
    return ""


def count_launches(
    fn: Callable[[], object], device: torch.device
) -> tuple[int | None, int | None, str]:
    """(kernels, memsets and copies) one call of `fn` puts on the GPU, read from torch.profiler's
    device events; (None, None, why) without a GPU."""
    if device.type != "cuda":
        return None, None, "no CUDA device: launches are counted from the GPU's kernel events"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiles and caches outside the profiled call
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    memops = sum(1 for e in events if e.name.startswith(("Memset", "Memcpy")))
    return len(events) - memops, memops, ""


def _permuted_rows(cfg: ForwardConfig, taps: Taps) -> int:
    """Rows the GEMMs run over in the tapped call: M_sum, or E_l * capacity when batched."""
    if cfg.layout == BATCHED:
        a = taps[Stage.DISPATCH.value]["a_batched"]
        return a.shape[0] * a.shape[1]
    return int(taps[Stage.ALIGN.value]["M_sum"])


def _slice_inputs(inputs: MoEInputs, tokens: int) -> MoEInputs:
    """The first `tokens` tokens of `inputs` (weights shared): one set of weights serves every
    decode size, and each token's routing depends on its own logits only."""

    def head(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[:tokens]

    return dataclasses.replace(
        inputs,
        hidden_states=inputs.hidden_states[:tokens],
        router_logits=inputs.router_logits[:tokens],
        topk_ids=head(inputs.topk_ids),
        topk_weights=head(inputs.topk_weights),
    )


def _measure(
    problem: MoEProblem,
    inputs: MoEInputs,
    rank: int,
    engine: Engine,
    repeats: int,
    bandwidth: float,
    verification: bool,
    backend: str,
) -> ProductionBench:
    device = inputs.hidden_states.device
    on_gpu = device.type == "cuda"
    cfg = ForwardConfig.for_problem(problem, rank, problem.tokens, engine)
    capture = on_gpu and cfg.capturable
    timing = GRAPH_TIMING if capture else (HT_TIMING if on_gpu else CPU_TIMING)
    judged = timing == GRAPH_TIMING
    route = ReferenceBackend().route(StageContext(problem, inputs, Trace("golden"), rank))
    hidden = inputs.hidden_states
    if "token_index" in route:  # ep:N+ht: this rank computes only the tokens it receives
        hidden = hidden[route["token_index"]]
    ids, weights_k = route["topk_ids"], route["topk_weights"]
    weights = prepare_rank_weights(cfg, inputs.w13_q, inputs.w2_q)
    t = hidden.shape[0]
    layout = workspace_layout(cfg, t)
    workspace = torch.empty(workspace_bytes(cfg, t), dtype=torch.uint8, device=device)
    runner = op.registered_backend(backend)
    taps: Taps = {}
    production.forward(runner, cfg, hidden, ids, weights_k, weights, workspace, taps)
    upstream = Trace(runner.name, rank)
    for name, outputs in taps.items():
        upstream.add(name, outputs)
    x = rank_inputs(hidden, weights)
    shard, buffers = rank_shard(cfg, weights), CarvedBuffers(layout, workspace)
    traffic = traffic_of(cfg, hidden, taps)
    absent = _deepgemm_absent(cfg, problem, engine, device)

    rows = []
    floor_total = 0.0
    gemms_alone: float | None = 0.0
    stages = forward_stages(problem)
    for stage in progress.steps(stages, f"bench --production {problem.id}", "stage", label=str):

        def call(stage: Stage = stage) -> None:
            call_stage(runner, stage, production_context(cfg, x, upstream, shard, buffers))

        seconds = _time(call, capture, device, repeats)
        if stage in FLOORED_STAGES:
            nbytes = floor_bytes(stage, traffic)
            floor_total += nbytes / bandwidth
            rows.append(memory_row(stage, seconds, nbytes, bandwidth, problem.tokens, judged))
        elif stage in GEMM_STAGES:
            alone = None
            if not absent:
                alone = _time(_deepgemm_alone(cfg, stage, taps, weights), capture, device, repeats)
            gemms_alone = None if alone is None or gemms_alone is None else gemms_alone + alone
            rows.append(gemm_row(stage, seconds, alone, absent, problem.tokens, judged))
        else:
            rows.append(StageRow(stage.value, seconds * 1e6, note=NO_TARGET[stage]))

    forward = functools.partial(op.call, cfg, hidden, ids, weights_k, weights, workspace, backend)
    forward_s = _time(forward, capture, device, repeats)
    kernels, memops, launch_note = count_launches(forward, device)
    return ProductionBench(
        problem=problem,
        rank=rank,
        engine=cfg.engine.value,
        layout=cfg.layout,
        timing=timing,
        repeats=repeats,
        environment=Environment.here(device),
        bandwidth=bandwidth,
        traffic=traffic,
        m_sum_rows=_permuted_rows(cfg, taps),
        stages=tuple(rows),
        forward_us=forward_s * 1e6,
        gemms_alone_us=None if gemms_alone is None else gemms_alone * 1e6,
        floor_us=floor_total * 1e6,
        launches=kernels,
        memops=memops,
        launch_note=launch_note,
        **(
            _verification(problem, inputs, rank, cfg.engine, repeats, backend)
            if verification
            else {}
        ),
    )


def _verification(
    problem: MoEProblem, inputs: MoEInputs, rank: int, engine: Engine, repeats: int, name: str
) -> dict[str, object]:
    """Verification mode's stages, each fed the backend's own upstream (chained), on the
    production engine: eager calls of the registered backend's methods with every host check it
    runs (a verification context: validation on, no workspaces); beside each, the same call with
    validation off and the host reads the checked call made (what the checks cost, and why)."""
    backend = op.registered_backend(name)
    shard_of = ShardCache()
    trace = run_stages(backend, problem, inputs, rank, shard_of=shard_of, engine=engine)
    rows = []
    for stage in problem.stages:
        if stage is Stage.ROUTE:
            continue  # production takes the routing as its input
        ctx = StageContext(
            problem, inputs, trace.upto(stage), rank, engine=engine, shard_of=shard_of
        )
        unchecked = dataclasses.replace(ctx, validate=False)
        reads = HostReads()
        with reads.counting():
            call_stage(backend, stage, ctx)
        rows.append(
            VerificationRow(
                stage.value,
                median_seconds(functools.partial(call_stage, backend, stage, ctx), repeats) * 1e6,
                median_seconds(functools.partial(call_stage, backend, stage, unchecked), repeats)
                * 1e6,
                len(reads.found),
            )
        )
    forward = functools.partial(
        _verification_forward, backend, problem, inputs, rank, engine, shard_of, trace
    )
    return {
        "verification": tuple(rows),
        "verification_forward_us": median_seconds(forward, repeats) * 1e6,
    }


def _verification_forward(
    backend: object,
    problem: MoEProblem,
    inputs: MoEInputs,
    rank: int,
    engine: Engine,
    shard_of: ShardCache,
    routed: Trace,
) -> None:
    """Verification mode's forward as a run makes it: every stage after the routing called
    eagerly in turn, chained, with its host checks, and nothing waited for in between but what
    the checks read (the per-stage rows time each call alone, each ending in a sync)."""
    trace = routed.upto(next(s.value for s in problem.stages if s is not Stage.ROUTE))
    for stage in problem.stages:
        if stage is Stage.ROUTE:
            continue
        ctx = StageContext(problem, inputs, trace, rank, engine=engine, shard_of=shard_of)
        trace.add(stage.value, call_stage(backend, stage, ctx))


def _checked(
    problem: object, rank: object, engine: object, repeats: object, device: object
) -> tuple[MoEProblem, int, Engine, int, torch.device]:
    if not isinstance(problem, MoEProblem):
        raise TypeError(f"problem: expected a MoEProblem, got {type(problem).__name__}")
    if problem.tokens < 1:
        raise ValueError(f"problem.tokens: expected >= 1 to time a forward, got {problem.tokens}")
    rank = check_int(f"rank (topology {problem.topology})", rank, 0, problem.topology.size - 1)
    repeats = check_int("repeats", repeats, 1, 1 << 20)
    dev = default_device() if device is None else torch.device(device)
    if dev.type == "cpu" and default_device().type == "cuda":
        raise ValueError(
            "device: expected the GPU on a machine that has one (the Triton kernels run on the "
            "CPU only under the interpreter: hide the GPU with CUDA_VISIBLE_DEVICES= to time "
            f"that), got {dev}"
        )
    return problem, rank, deepgemm.as_engine(engine), repeats, dev


def _bandwidth(device: torch.device) -> float:
    # On a CPU the number only feeds the plumbing: a 16 MiB copy keeps the tests fast.
    return copy_bandwidth(device) if device.type == "cuda" else copy_bandwidth(device, 1 << 24, 3)


def bench_production(
    problem: MoEProblem,
    rank: int = 0,
    engine: Engine | str = Engine.AUTO,
    repeats: int = 20,
    device: torch.device | str | None = None,
    verification: bool = True,
    backend: str = "optimized",
) -> ProductionBench:
    """Time `rank` of `problem` in production mode beside DeepGEMM alone and the byte floor,
    with verification mode's times apart (`verification=False` leaves them out). `backend`: the
    registered backend the op runs (`moe_verify.run.runner.production_backend` registers one)."""
    problem, rank, engine, repeats, dev = _checked(problem, rank, engine, repeats, device)
    op.registered_backend(backend)  # a clear error before any work
    inputs = make_inputs(problem, dev)
    bandwidth = _bandwidth(dev)
    return _measure(problem, inputs, rank, engine, repeats, bandwidth, verification, backend)


def bench_decode(
    problem: MoEProblem,
    tokens: Sequence[int] = DECODE_TOKENS,
    rank: int = 0,
    engine: Engine | str = Engine.AUTO,
    repeats: int = 20,
    device: torch.device | str | None = None,
    backend: str = "optimized",
) -> DecodeBench:
    """The production forward of `problem` at each decode size in `tokens` (problem.tokens is
    replaced): latency, the two GEMMs alone, their ratio, launches, per-stage latencies. One set
    of inputs is made at the largest T and its first T tokens feed each size."""
    problem, rank, engine, repeats, dev = _checked(problem, rank, engine, repeats, device)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not tokens:
        raise ValueError(f"tokens: expected a non-empty sequence of token counts, got {tokens!r}")
    sizes = [check_int("tokens[]", t, 1, MAX_TOKENS) for t in tokens]
    inputs = make_inputs(problem.replace(tokens=max(sizes)), dev)
    bandwidth = _bandwidth(dev)
    rows = tuple(
        _measure(
            problem.replace(tokens=t),
            _slice_inputs(inputs, t),
            rank,
            engine,
            repeats,
            bandwidth,
            verification=False,
            backend=backend,
        )  # fmt: skip
        for t in sizes
    )
    return DecodeBench(problem, rows)
