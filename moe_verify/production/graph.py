"""`moe-verify graph`: capture the production op once at a token bound, replay it with routing
that changes between replays, and compare every replay, stage by stage, with the golden.

What vLLM ships replays one CUDA graph per batch-size bucket: the per-expert counts, the live
token count and the padding rows change under a graph whose shapes, workspaces and DeepGEMM
scheduling were fixed at capture (vLLM's CUDA-graph mode). Bugs that live only there: an IMA only
on a replay with a different expert distribution (DeepGEMM #444), stale positive ids in padding
rows read past expert_map (vLLM test_expert_map_bounds), metadata of an earlier call reused.

Each replay stages new inputs into the graph's static buffers (only the live rows: padding rows
keep what the previous replay left there, as vLLM's do, plus planted stale positive ids), then:

- poisons the workspace and NaN-fills the graph's output, so nothing an earlier replay wrote can
  pass for this replay's result;
- replays every rank's graph and reads the stage taps (the stage outputs captured as graph-resident
  tensors, optimized/op.py `recording`), so a failing replay names its first divergent stage;
- runs the golden on exactly the inputs the op saw (ids outside the expert table are skipped, as
  the op must skip them) and compares each rank's taps in chained mode, and the ranks' sum;
- guards, after FlashInfer's test_da_capture_rebinding: the golden is not degenerate, consecutive
  replays differ, and a NaN-filled output of the warm-up call, kept alive with every earlier
  allocation so no address is recycled, is never written again.

The op runs the tested backend's own stage methods (the class `moe-verify run` verifies, given
as `--backend`), graph-safe. The warm-up call counts host reads
(moe_verify/production/host_reads.py): a
stage that reads the device on the host cannot be captured, so the report names the stage, the
call and the line, fails, and runs the replays eagerly so every stage is still compared.

A kernel fault (a segfault, an illegal memory access) must not take the run down: the CLI runs
`verify_graph` in a child process (moe_verify/cli.py) with a breadcrumb file, which names the
replay, rank and stage in flight (`breadcrumb`), and reports a crash with them.

Without a GPU there is no capture: every "replay" is an eager call of the op on the same static
buffers, and the report says so. Everything else (staging, stale padding, taps, guards, the
comparison) runs the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_verify.common.device import default_device
from moe_verify.production.host_reads import HostReads
from moe_verify.run.contain import Completed, run_contained
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import RankRun
from moe_verify.run.verify import compare_reduce, engine_of, has_reduce, rank_experts
from moe_verify.spec import (
    Engine,
    Mode,
    MoEProblem,
    Routing,
    Stage,
    StageContext,
    TopologyKind,
    Trace,
    ceil_div,
    run_stages,
)
from optimized import op, production
from optimized.production import (
    ForwardConfig,
    RankWeights,
    prepare_rank_weights,
    workspace_bytes,
)
from reference.moe import ReferenceBackend
from tolerance.compare import compare
from tolerance.report import Report

# Stale positive ids planted in padding rows: vLLM's test_expert_map_bounds uses these two (they
# come from torch.empty bit patterns); in-range ids are planted beside them.
STALE_IDS = (123456789, 2071690107)
# The workspace poison before each replay: 0xFF is NaN in bf16 and e4m3, -1 in int32.
WORKSPACE_POISON = 0xFF


BREADCRUMB_ENV = "MOE_VERIFY_BREADCRUMB"


@contextlib.contextmanager
def breadcrumb(case: str, replay: str, rank: int) -> Iterator[None]:
    """While inside, the breadcrumb file ($MOE_VERIFY_BREADCRUMB) names the case, replay and rank
    in flight and, for every eager stage call, the stage: what a crash report can say. An
    exception raised inside (a backend's own error) leaves with a note naming the same, which
    `moe-verify graph` prints beside it; its type and message are the backend's."""
    path = os.environ.get(BREADCRUMB_ENV)
    entered: list[str] = []

    def write(stage: str | None) -> None:
        if stage is not None:
            entered.append(stage)
        if path:
            crumb = {"case": case, "replay": replay, "rank": rank, "stage": stage}
            Path(path).write_text(json.dumps(crumb) + "\n")

    write(None)
    production.stage_listeners.append(write)
    try:
        yield
    except Exception as exc:
        # A replay of the captured graph calls no stage method, so no stage is entered there.
        stage = f", stage {entered[-1]}" if entered else f", {STAGE_UNKNOWN}"
        exc.add_note(f"raised in graph {case}: replay {replay}, rank {rank}{stage}")
        with contextlib.suppress(AttributeError, TypeError):  # a C type may refuse attributes
            exc.graph_at = {  # type: ignore[attr-defined]
                "case": case,
                "replay": replay,
                "rank": rank,
                "stage": entered[-1] if entered else None,
            }
        raise
    finally:
        production.stage_listeners.remove(write)


STAGE_UNKNOWN = "stage unknown (inside a captured graph, or before the first stage)"


def is_kernel_fault(exc: BaseException) -> bool:
    """A CUDA error torch raised: a kernel faulted on the GPU (an illegal address, a trap), found
    at the next sync. Raised in a replay, it is the backend's kernels' fault: the only kernels a
    replay runs before its first sync are the captured graph's."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith("CUDA error")


def describe_fault(case: str, exc: BaseException) -> tuple[str, str]:
    """The line `graph` prints for a kernel fault raised in its own process (a CUDA error at a
    sync; a segfault ends the child instead, `Contained`) and its JSON report."""
    at = getattr(exc, "graph_at", None)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    c = at or {}
    where = ", ".join(
        f"{name} {c[name]}" for name in ("replay", "rank", "stage") if c.get(name) is not None
    )
    if c.get("replay") and c.get("stage") is None:
        where += f", {STAGE_UNKNOWN}"
    line = (
        f"FAULT graph {case}: {type(exc).__name__}: {message} "
        f"({where or 'before the first replay'}); a kernel faulted on the GPU, not this run. "
        "The CUDA context is lost, so no later replay ran: `moe-verify run` on the same problem "
        "locates the stage eagerly"
    )
    report = json.dumps(
        {"case": case, "passed": False, "faulted": f"{type(exc).__name__}: {message}", "at": at},
        indent=2,
    )
    return line, report


@dataclass(frozen=True)
class Replay:
    """One replay's inputs: `routing` over the first `live` tokens of the bound, a seed of its
    own, and (when live < bound) stale positive ids planted in the padding rows."""

    name: str
    routing: Routing
    live: int
    seed: int

    def describe(self, bound: int) -> str:
        pad = f", {bound - self.live} padding rows with stale ids" if self.live < bound else ""
        return f"{self.name}: {self.routing.value} on {self.live} of {bound} tokens{pad}"


def default_replays(bound: int, seed: int = 0) -> list[Replay]:
    """The replays `graph` runs: each changes what the previous one fixed.

    The first is also the capture's input. Order matters: `one_expert` needs more rows in one
    expert than any earlier replay gave it, `invalid_slots` follows it with -1 slots, the short
    replays leave padding rows behind for the next one, and the last repeats the first routing
    with new data (the output must still change).
    """
    half, one = max(1, bound // 2), 1
    rows = [
        ("capture-softmax", Routing.SOFTMAX, bound),  # the routing the graph was captured with
        ("skew", Routing.SKEW, bound),  # a hot expert: per-expert counts change a lot
        ("empty-middle", Routing.EMPTY_MIDDLE, bound),  # an expert that had rows gets none
        ("one-expert", Routing.ONE_EXPERT, bound),  # one expert needs more rows than ever before
        ("invalid-slots", Routing.INVALID_SLOTS, bound),  # -1 slots, some tokens with none
        ("half-live", Routing.SOFTMAX, half),  # fewer live tokens: stale ids in padding rows
        ("one-live", Routing.DUPLICATES, one),  # a single live token (decode), duplicate ids
        ("softmax-again", Routing.SOFTMAX, bound),  # the first routing again, new data
    ]
    return [
        Replay(name, routing, live, seed + 1 + i) for i, (name, routing, live) in enumerate(rows)
    ]


@dataclass(frozen=True)
class Guard:
    """A replay-level check (not a stage's): its name, whether it held, and what it saw."""

    name: str
    passed: bool
    detail: str


@dataclass
class ReplayResult:
    replay: Replay
    report: Report
    guards: list[Guard]

    @property
    def passed(self) -> bool:
        return self.report.passed and all(g.passed for g in self.guards)

    @property
    def first_failure(self) -> str | None:
        """The first failing stage, else the first failing guard's name, else None."""
        stage = self.report.first_failure
        if stage is not None:
            return str(stage)
        return next((g.name for g in self.guards if not g.passed), None)


@dataclass
class GraphReport:
    """Every replay of one captured graph (one per rank)."""

    problem: MoEProblem
    bound: int
    captured: bool
    capture_note: str
    backend: str
    engine: str
    replays: list[ReplayResult] = field(default_factory=list)
    # stage -> its first host read (moe_verify/production/host_reads.py): such a stage cannot be
    # captured.
    host_reads: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.host_reads and all(r.passed for r in self.replays)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_summary(self, verbose: bool = False) -> str:
        """A line per replay and a failing one's report under it; `verbose` (`graph -v`): every
        replay's table, passing or not, every check of every rank with the limits' reasons
        (`Report.to_table`, what `run -v` prints)."""
        mode = "CUDA-graph replays" if self.captured else "eager replays"
        lines = [
            f"graph {self.problem.id}: backend {self.backend}, {self.engine} GEMMs, captured at "
            f"{self.bound} tokens; {mode} ({self.capture_note})"
        ]
        for stage, read in self.host_reads.items():
            lines.append(
                f"  NOT GRAPH-SAFE {stage}: reads the device on the host ({read}); a CUDA graph "
                "cannot capture it"
            )
        for r in self.replays:
            verdict = "PASS" if r.passed else f"FAIL at {r.first_failure}"
            lines.append(f"  {verdict:<26} {r.replay.describe(self.bound)}")
            if not r.passed:
                for g in r.guards:
                    if not g.passed:
                        lines.append(f"      guard {g.name}: {g.detail}")
                if r.report.first_failure is not None and not verbose:
                    lines.extend("      " + line for line in r.report.to_summary().splitlines())
            if verbose:
                lines.extend("      " + line for line in r.report.to_table().splitlines())
        failed = sum(not r.passed for r in self.replays)
        unsafe = f"; {len(self.host_reads)} stage(s) not graph-safe" if self.host_reads else ""
        lines.append(
            f"{'PASS' if self.passed else 'FAIL'}: {len(self.replays) - failed} of "
            f"{len(self.replays)} replays agree with the golden{unsafe}"
        )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "case": self.problem.id,
                "bound": self.bound,
                "captured": self.captured,
                "capture_note": self.capture_note,
                "backend": self.backend,
                "engine": self.engine,
                "passed": self.passed,
                "host_reads": self.host_reads,
                "replays": [
                    {
                        "name": r.replay.name,
                        "routing": r.replay.routing.value,
                        "live": r.replay.live,
                        "passed": r.passed,
                        "first_failure": r.first_failure,
                        "guards": [dataclasses.asdict(g) for g in r.guards],
                        "stages": json.loads(r.report.to_json()),
                    }
                    for r in self.replays
                ],
            },
            indent=2,
        )


class _GivenRoute(ReferenceBackend):
    """The golden, routed by the ids the op was given (physical, ids outside the expert table
    skipped) instead of computing its own."""

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        super().__init__()
        self._ids, self._weights = ids, weights

    def route(self, ctx: StageContext) -> dict[str, object]:
        return {"topk_ids": self._ids, "topk_weights": self._weights}


def check_graphable(problem: MoEProblem) -> None:
    """Refuse what production mode cannot capture, saying why."""
    if problem.topology.kind is TopologyKind.EP_HT:
        raise ValueError(
            f"graph: {problem.topology} cannot be captured: the exact-count path reads the "
            "per-expert counts on the host to size M_sum (vLLM runs DeepEP high-throughput "
            "eagerly); use ep:N or ep:N+ll"
        )
    if problem.shared_experts:
        raise ValueError(
            "graph: shared experts run outside the fused MoE op in vLLM; verify them with "
            f"`moe-verify run` (got shared_experts={problem.shared_experts})"
        )


@dataclass
class _Rank:
    """One rank's captured op: config, weights, workspace, and the graph's output and taps."""

    cfg: ForwardConfig
    weights: RankWeights
    workspace: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None
    taps: dict[str, dict[str, object]] = field(default_factory=dict)


class GraphSession:
    """The static buffers, one captured op per rank, and what each replay stages into them."""

    def __init__(
        self,
        problem: MoEProblem,
        bound: int,
        engine: Engine | str = Engine.AUTO,
        backend: str = "optimized",
        device: torch.device | str | None = None,
        capture: bool | None = None,
    ) -> None:
        check_graphable(problem)
        if bound < 1:
            raise ValueError(f"graph: bound must be >= 1 token, got {bound}")
        op.registered_backend(backend)  # a clear error now rather than at capture
        self.problem = dataclasses.replace(problem, tokens=bound)
        self.bound = bound
        self.backend = backend
        self.device = torch.device(device) if device is not None else default_device()
        cuda = self.device.type == "cuda"
        self.capture = cuda if capture is None else capture
        if self.capture and not cuda:
            raise ValueError("graph: capture needs a CUDA device")
        self.base = make_inputs(self.problem).to(self.device)
        h, k = problem.hidden, problem.topk
        self.hidden = torch.zeros(bound, h, dtype=torch.bfloat16, device=self.device)
        self.ids = torch.full((bound, k), -1, dtype=torch.int32, device=self.device)
        self.weights = torch.zeros(bound, k, dtype=torch.float32, device=self.device)
        self.ranks = []
        for rank in range(self.problem.topology.size):
            cfg = ForwardConfig.for_problem(self.problem, rank, bound, engine)
            w = prepare_rank_weights(cfg, self.base.w13_q, self.base.w2_q)
            ws = torch.empty(workspace_bytes(cfg, bound), dtype=torch.uint8, device=self.device)
            self.ranks.append(_Rank(cfg, w, ws))
        self.engine = self.ranks[0].cfg.engine.value
        # Every tensor any replay staged or returned, and the warm-up outputs: never freed, so
        # no later allocation can take an address a stale pointer in the graph still holds.
        self.keepalive: list[torch.Tensor] = []
        self.sentinels: list[torch.Tensor] = []
        self.host_reads: dict[str, str] = {}

    @property
    def num_experts_table(self) -> int:
        """Ids at or past this are outside the expert table (physical experts under EPLB)."""
        emap = self.ranks[0].weights.expert_map
        return emap.numel() if emap is not None else self.problem.num_experts

    # -- staging -------------------------------------------------------------------------------

    def stage(self, replay: Replay) -> None:
        """Write `replay`'s live rows into the static buffers; plant stale ids in the padding."""
        if not 1 <= replay.live <= self.bound:
            raise ValueError(f"replay {replay.name}: live must be in [1, {self.bound}]")
        p = dataclasses.replace(
            self.problem, tokens=replay.live, routing=replay.routing, seed=replay.seed
        )
        x = make_inputs(p).to(self.device)
        route = ReferenceBackend().route(StageContext(p, x, Trace("golden")))
        live = replay.live
        self.hidden[:live].copy_(x.hidden_states)
        self.ids[:live].copy_(route["topk_ids"].to(torch.int32))
        self.weights[:live].copy_(route["topk_weights"])
        if live < self.bound:
            plant = torch.tensor(
                [*STALE_IDS, self.num_experts_table - 1, 0], dtype=torch.int32, device=self.device
            )
            pad = self.ids[live:].reshape(-1)
            pad.copy_(plant.repeat(ceil_div(pad.numel(), plant.numel()))[: pad.numel()])
        self.keepalive.extend([x.hidden_states, route["topk_ids"], route["topk_weights"]])

    def effective_route(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids and weights as the op must read them: ids outside the table are skipped."""
        ids = self.ids.clone()
        ids[(ids < 0) | (ids >= self.num_experts_table)] = -1
        return ids, self.weights.clone()

    # -- the op ----------------------------------------------------------------------------------

    def _call(self, r: _Rank) -> torch.Tensor:
        return op.call(r.cfg, self.hidden, self.ids, self.weights, r.weights, r.workspace,
                       self.backend)  # fmt: skip

    def _warm_up(self, r: _Rank) -> torch.Tensor:
        """One eager call (JIT compiles happen outside capture; on a side stream when a capture
        follows, as torch.cuda.graph asks), with host reads counted: a stage that reads cannot
        be captured (`host_reads`: stage -> its first read)."""
        with HostReads().counting() as reads:
            if not self.capture:
                warm = self._call(r)
            else:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    warm = self._call(r)
                torch.cuda.current_stream(self.device).wait_stream(side)
        for stage, read in reads.by_stage().items():
            self.host_reads.setdefault(stage, str(read))
        return warm

    def warm_up_and_capture(self) -> str:
        """The warm-up call of every rank, then (no stage reading the host) the capture.
        Returns how the replays will run."""
        for rank, r in enumerate(self.ranks):
            with breadcrumb(self.problem.id, "warm-up", rank):
                warm = self._warm_up(r)
            warm.fill_(float("nan"))
            self.sentinels.append(warm)
        if self.host_reads:
            self.capture = False
            return (
                f"not captured: {', '.join(self.host_reads)} read(s) the device on the host; "
                "each replay is an eager op call on the static buffers"
            )
        if not self.capture:
            return "no CUDA device: each replay is an eager op call on the static buffers"
        for rank, r in enumerate(self.ranks):
            r.graph = torch.cuda.CUDAGraph()
            with (
                breadcrumb(self.problem.id, "capture", rank),
                op.recording(r.taps),
                torch.cuda.graph(r.graph),
            ):
                r.out = self._call(r)
        torch.cuda.synchronize(self.device)
        return "captured once per rank with torch.cuda.graph"

    def replay_rank(self, r: _Rank) -> tuple[torch.Tensor, Trace]:
        """Poison, replay (or call), and read this rank's output and taps as a Trace."""
        r.workspace.fill_(WORKSPACE_POISON)
        if self.capture:
            assert r.graph is not None and r.out is not None
            r.out.fill_(float("nan"))
            r.graph.replay()
            torch.cuda.synchronize(self.device)
            out, taps = r.out, r.taps
        else:
            taps: dict[str, dict[str, object]] = {}
            with op.recording(taps):
                out = self._call(r)
        trace = Trace(f"{self.backend} (graph replay)")
        for stage, outputs in taps.items():
            if stage == Stage.ROUTE.value:
                continue
            trace.add(stage, {n: v.clone() if isinstance(v, torch.Tensor) else v
                              for n, v in outputs.items()})  # fmt: skip
        return out.clone(), trace


def _golden(session: GraphSession, ids: torch.Tensor, weights: torch.Tensor) -> list[Trace]:
    x = dataclasses.replace(session.base, hidden_states=session.hidden.clone())
    golden = _GivenRoute(ids, weights)
    return [run_stages(golden, session.problem, x, rank) for rank in range(len(session.ranks))]


def _with_route(trace: Trace, golden: Trace) -> Trace:
    """The tested trace with the route it was given (the op's input, not its output) first."""
    routed = Trace(trace.backend, golden.rank)
    routed.add(Stage.ROUTE, dict(golden[Stage.ROUTE]))
    for stage in trace.stages:
        routed.add(stage, dict(trace[stage]))
    return routed


def _guards(
    session: GraphSession, outs: list[torch.Tensor], golden: list[Trace], previous: list | None
) -> list[Guard]:
    gold = torch.stack([g[Stage.GATHER]["out"].float() for g in golden]).to(outs[0].device)
    degenerate = not bool(torch.isfinite(gold).all()) or not bool((gold != 0).any())
    guards = [
        Guard(
            "golden-not-degenerate",
            not degenerate,
            "the golden's output is finite and not all zero"
            if not degenerate
            else "the golden's output is all zero or not finite: this replay proves nothing",
        )
    ]
    if previous is not None:
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in zip(outs, previous, strict=True))  # fmt: skip
        guards.append(
            Guard(
                "replays-differ",
                not same,
                "the output changed since the previous replay"
                if not same
                else "the output is bit for bit the previous replay's: the graph did not see "
                "the new inputs (a stale input binding)",
            )
        )
    written = [int((~torch.isnan(s.float())).sum()) for s in session.sentinels]
    guards.append(
        Guard(
            "no-stale-writes",
            not any(written),
            "the warm-up call's NaN-filled output is untouched"
            if not any(written)
            else f"{sum(written)} elements of the warm-up call's output were written by a "
            "replay: a kernel writes through a pointer of an earlier call",
        )
    )
    return guards


def verify_graph(
    problem: MoEProblem,
    *,
    bound: int | None = None,
    replays: Sequence[Replay] | None = None,
    engine: Engine | str = Engine.AUTO,
    backend: str = "optimized",
    device: torch.device | str | None = None,
    capture: bool | None = None,
) -> GraphReport:
    """Capture the production op of every rank at `bound` tokens (default: problem.tokens),
    replay it under `replays` (default: `default_replays`), and compare each replay with the
    golden of that replay's inputs, stage by stage (chained: the op runs end to end)."""
    bound = problem.tokens if bound is None else bound
    session = GraphSession(problem, bound, engine, backend, device, capture)
    replays = list(replays) if replays is not None else default_replays(bound, problem.seed)
    if not replays:
        raise ValueError("graph: at least one replay")
    session.stage(replays[0])
    note = session.warm_up_and_capture()
    report = GraphReport(
        session.problem, bound, session.capture, note, backend, session.engine,
        host_reads=session.host_reads,
    )  # fmt: skip
    previous = None
    stages = [s for s in session.problem.stages if s is not Stage.ROUTE]
    for replay in replays:
        session.stage(replay)
        ids, weights = session.effective_route()
        golden = _golden(session, ids, weights)
        outs, runs, results = [], [], []
        for rank, r in enumerate(session.ranks):
            with breadcrumb(session.problem.id, replay.name, rank):
                out, taps = session.replay_rank(r)
            tested = _with_route(taps, golden[rank])
            outs.append(out)
            runs.append(RankRun(rank, golden[rank], {Mode.CHAINED: tested}))
            rank_results = compare(golden[rank], tested, session.problem, stages, mode=Mode.CHAINED)
            shown_rank = rank if session.problem.topology.size > 1 else None
            rank_results = [
                dataclasses.replace(x, rank=shown_rank, engine=engine_of(tested, x.stage))
                for x in rank_results
            ]
            results.extend(rank_results)
        if has_reduce(session.problem):
            results.append(compare_reduce(session.problem, runs, Mode.CHAINED))
        rep = Report(
            session.problem,
            f"{backend} (graph replay {replay.name})",
            Mode.CHAINED,
            chained=results,
            rank_experts=rank_experts(session.problem),
        )
        report.replays.append(ReplayResult(replay, rep, _guards(session, outs, golden, previous)))
        previous = outs
        session.keepalive.extend(outs)
    return report


# -- containment ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contained:
    """How a `graph` child process ended: its exit (`Completed`) and the last breadcrumb (the
    case, replay, rank and stage in flight), None when it wrote none."""

    done: Completed
    crumb: dict[str, object] | None

    @property
    def crashed(self) -> bool:
        """Killed by a signal, out of time, or an exit status `graph` never uses."""
        return self.done.timed_out or self.done.rc not in (0, 1, 2)

    def describe(self, case: str) -> str:
        c = self.crumb or {}
        where = ", ".join(
            f"{name} {c[name]}" for name in ("replay", "rank", "stage") if c.get(name) is not None
        )
        if c.get("replay") and c.get("stage") is None:
            where += f", {STAGE_UNKNOWN}"
        return (
            f"CRASH graph {case}: the child process was {self.done.exit_text} "
            f"({where or 'before the first replay'}); a kernel fault ended it, not this run"
        )

    def to_json(self, case: str) -> str:
        return json.dumps(
            {"case": case, "passed": False, "crashed": self.done.exit_text, "at": self.crumb},
            indent=2,
        )


def run_graph_contained(argv: Sequence[str], timeout_s: float | None) -> Contained:
    """`moe-verify graph` (its `argv`) in a child process of its own, with a breadcrumb file:
    a segfault or an illegal memory access in a kernel ends the child, not the caller."""
    with tempfile.TemporaryDirectory(prefix="moe-verify-graph-") as tmp:
        crumb_path = Path(tmp) / "breadcrumb.json"
        env = {**os.environ, BREADCRUMB_ENV: str(crumb_path)}
        cmd = [sys.executable, "-m", "moe_verify.cli", *argv, "--in-process"]
        done = run_contained(cmd, timeout_s, env)
        crumb = json.loads(crumb_path.read_text()) if crumb_path.exists() else None
    return Contained(done, crumb)
