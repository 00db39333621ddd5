"""`moe-verify calibrate`: measure the noise floor of every policy check, per stage and recipe.

For each case and seed, four comparisons run against the fp32 golden, and each check's value is
kept next to its policy limit; per (case, source, stage, check) the table shows the largest value
over seeds and headroom = value / limit (100% is at the limit):

  golden64 isolated / chained   the golden with fp64 GEMM accumulation: the golden's own floor
  <backend> isolated / chained  the tested backend, exactly as `verify` compares it

and, apart, the accuracy cost of E8M0 scales: the golden output of the same case under each scale
format of its recipe against a bf16 MoE on the unquantized master weights.

Check values are the CheckResults of `verify_rank`, the numbers a verification reports. The one
number it does not return, the worst element's excess ratio |a-b| / (atol*rowmax|golden| +
rtol*|golden|), is measured with `tolerance.metrics` on the rows `tolerance.compare.keyed_values`
keys by (token, k), the keying the bounded checks themselves use.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_verify.common import progress
from moe_verify.run.contain import DEFAULT_CASE_TIMEOUT_S, CaseTimeout, deadline
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import resolve_backend, run_golden
from moe_verify.run.verify import has_reduce, reduce_traces, verify_rank
from moe_verify.spec import (
    REPORT_STAGES,
    Backend,
    GemmRecipe,
    Mode,
    MoEProblem,
    Recipe,
    ScaleFmt,
    Stage,
    Status,
    Topology,
    Trace,
)
from reference import ReferenceBackend
from reference.master import master_moe
from tolerance.compare import StageResult, compare_stage, keyed_values
from tolerance.metrics import calc_diff, excess_ratio, row_max, row_rel_error
from tolerance.policy import policy_for

P = MoEProblem
# A = 32 keeps M_sum, and so the interpreter's time, near the live rows (padding is never compared).
_SHAPE = dict(tokens=64, hidden=256, intermediate=256, num_experts=4, topk=2, alignment=32)

# The default calibration list: every recipe and scale format once, the cross-rank sums, and the
# clamped activation, at shapes the Triton interpreter runs in seconds. Each row names its edge.
CALIBRATION: list[MoEProblem] = [
    P(**_SHAPE),  # fp8_block, plain fp32 scales (the SM90 default; colmajor act_quant)
    P(**_SHAPE, scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0, topology="tp:2"),
    # ^ Hopper E8M0 (requantized weights); reduce of TP partials, which cancel
    P(**_SHAPE, scale_fmt=ScaleFmt.UE8M0_PACKED, activation="swigluoai"),
    # ^ SM100 packed scales, packed act_quant rounding; alpha, beta and clamp around tl.exp
    P(**_SHAPE, recipe=Recipe.MXFP8, scale_fmt=ScaleFmt.UE8M0_PACKED),  # 1x32 groups both sides
    P(**_SHAPE, recipe=Recipe.MXFP4_W4A8, scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0),  # E2M1 weights
    P(**_SHAPE, recipe=Recipe.MXFP4_W4A8, scale_fmt=ScaleFmt.UE8M0_PACKED),  # FP4, packed acts
    P(**_SHAPE, topology="ep:2"),  # reduce of the EP combine
]

EXCESS = "excess ratio"
_STAGE_ORDER = {s: i for i, s in enumerate(REPORT_STAGES)}


@dataclass
class Measurement:
    """One check of one stage under one source: its value per seed, against one policy limit.

    source is "<backend>/<mode>" ("golden64/isolated", "optimized/chained"); ranks fold into the
    stage (the worst rank counts).
    """

    case: str
    source: str
    stage: str
    check: str
    limit: float
    values: dict[int, float] = field(default_factory=dict)

    @property
    def value(self) -> float:
        """The largest value over seeds."""
        return max(self.values.values())

    @property
    def worst_seed(self) -> int:
        return max(self.values, key=lambda s: self.values[s])

    @property
    def headroom(self) -> float:
        """value / limit, the share of the limit used (0 where both are 0, inf past a 0 limit)."""
        return _fraction(self.value, self.limit)

    @property
    def bounded(self) -> bool:
        """A check with room between the floor and its limit (exact checks have limit 0)."""
        return self.limit > 0 or self.check == "elementwise"

    def to_dict(self) -> dict[str, object]:
        return {
            "case": self.case,
            "source": self.source,
            "stage": self.stage,
            "check": self.check,
            "value": _finite(self.value),
            "limit": self.limit,
            "headroom": _finite(self.headroom),
            "worst_seed": self.worst_seed,
            "per_seed": {str(s): _finite(v) for s, v in sorted(self.values.items())},
        }


@dataclass
class E8M0Cost:
    """The golden's end-to-end output under one scale format vs a bf16 master-weight MoE.

    calc_diff and rel_l2 = ||out - master|| / ||master|| over [T, H]; row_err = the worst token's
    max|out - master| / rowmax|master|. One entry per seed.
    """

    case: str
    family: str  # the case id under the recipe's first scale format: entries that differ only there
    recipe: str
    scale_fmt: str
    calc_diff: dict[int, float] = field(default_factory=dict)
    rel_l2: dict[int, float] = field(default_factory=dict)
    row_err: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        def per_seed(d: dict[int, float]) -> dict[str, float]:
            return {str(s): v for s, v in sorted(d.items())}

        return {
            "case": self.case,
            "family": self.family,
            "recipe": self.recipe,
            "scale_fmt": self.scale_fmt,
            "calc_diff": per_seed(self.calc_diff),
            "rel_l2": per_seed(self.rel_l2),
            "row_err": per_seed(self.row_err),
        }


@dataclass
class CalibrationResult:
    """Everything one calibration run measured, and where and how it ran."""

    seeds: int
    backend: str
    engine: str
    environment: dict[str, object]
    measurements: list[Measurement]
    e8m0: list[E8M0Cost]
    notes: list[str]
    seconds: dict[str, float]
    engines: dict[str, list[str]]  # case -> GEMM engines the tested backend reported
    out: str | None = None  # where the markdown was written

    def sources(self) -> list[str]:
        return list(dict.fromkeys(m.source for m in self.measurements))

    def worst(self) -> list[Measurement]:
        """Per (source, stage, check) of bounded checks, the measurement closest to its limit."""
        best: dict[tuple[str, str, str], Measurement] = {}
        for m in self.measurements:
            if not m.bounded:
                continue
            key = (m.source, m.stage, m.check)
            if key not in best or m.headroom > best[key].headroom:
                best[key] = m
        return sorted(best.values(), key=lambda m: (m.source, _stage_rank(m.stage), m.check))

    def to_dict(self) -> dict[str, object]:
        return {
            "seeds": self.seeds,
            "backend": self.backend,
            "engine": self.engine,
            "environment": self.environment,
            "seconds": self.seconds,
            "engines": self.engines,
            "measurements": [m.to_dict() for m in self.measurements],
            "e8m0": [c.to_dict() for c in self.e8m0],
            "notes": self.notes,
        }

    def to_markdown(self) -> str:
        return "\n".join(_markdown(self)) + "\n"

    def summary(self) -> str:
        """What the terminal gets when the tables went to a file: what ran, per source the
        bounded check closest to its limit, the checks over theirs, what was not measured, and
        where the files are."""
        cases = len(self.seconds) - ("total" in self.seconds)
        lines = [
            f"calibrated {cases} case(s) x {self.seeds} seed(s) in "
            f"{self.seconds.get('total', 0):g} s (backend {self.backend}, engine {self.engine})"
        ]
        worst = self.worst()
        for source in self.sources():
            ms = [m for m in worst if m.source == source]
            if ms:
                m = max(ms, key=lambda m: m.headroom)
                lines.append(
                    f"  {source}: closest to its limit {m.stage} {m.check} {_num(m.value)} / "
                    f"{_num(m.limit)} ({_pct(m).strip('*')}, {m.case})"
                )
        over = [m for m in self.measurements if m.limit > 0 and m.headroom > 1]
        if over:
            lines.append(f"  {len(over)} check(s) over their limits (bold in the table)")
        if self.notes:
            lines.append(f"  {len(self.notes)} not measured (listed under 'Not measured')")
        if self.out is not None:
            lines.append(f"wrote {self.out} and {Path(self.out).with_suffix('.json')}")
        return "\n".join(lines)


# Running -----------------------------------------------------------------------------------------


def calibrate(
    seeds: int,
    out: Path | None,
    cases: list[MoEProblem] | None = None,
    backend: str | Backend = "optimized",
    engine: str = "auto",
    case_timeout_s: float | None = DEFAULT_CASE_TIMEOUT_S,
) -> CalibrationResult:
    """Measure every case (default CALIBRATION) on seeds case.seed .. case.seed + seeds - 1.

    With `out`, the markdown goes there and the JSON beside it (out.with_suffix(".json")).
    A case that cannot run is recorded in `notes`, never dropped silently; so is one still
    running after `case_timeout_s` (per case and seed; None or 0: no limit).
    """
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    cases = list(CALIBRATION if cases is None else cases)
    tested = resolve_backend(backend, engine)
    start = time.perf_counter()
    table: dict[tuple[str, str, str, str], Measurement] = {}
    costs: dict[str, E8M0Cost] = {}
    notes: list[str] = []
    seconds: dict[str, float] = {}
    engines: dict[str, list[str]] = {}
    for case in progress.steps(cases, "calibrate", "case", label=lambda c: c.id):
        t0 = time.perf_counter()
        seen: set[str] = set()
        # Per rank and seed: the golden, then golden64 and the tested backend in both modes.
        stage_runs = case.topology.size * len(case.stages) * (1 + 2 * len(Mode))
        for i in range(seeds):
            problem = case.replace(seed=case.seed + i)
            try:
                with (
                    deadline(case_timeout_s, progress.where),
                    progress.case_bar(f"seed {i + 1}/{seeds}", stage_runs),
                ):
                    for source, stage, check, value, limit in _measure(
                        problem, tested, notes, seen
                    ):
                        key = (case.id, source, stage, check)
                        new = Measurement(case.id, source, stage, check, limit)
                        m = table.setdefault(key, new)
                        m.values[problem.seed] = max(value, m.values.get(problem.seed, -math.inf))
                    _e8m0_costs(case, problem.seed, costs)
            except (Exception, CaseTimeout) as exc:  # noqa: BLE001 - one case never ends the run
                notes.append(f"{problem.id}: not measured: {type(exc).__name__}: {exc}")
        seconds[case.id] = round(time.perf_counter() - t0, 2)
        engines[case.id] = sorted(seen)
    seconds["total"] = round(time.perf_counter() - start, 2)
    result = CalibrationResult(
        seeds=seeds,
        backend=tested.name,
        engine=engine,
        environment=_environment(),
        measurements=sorted(table.values(), key=_order),
        e8m0=list(costs.values()),
        notes=notes,
        seconds=seconds,
        engines=engines,
        out=str(out) if out is not None else None,
    )
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(result.to_markdown())
        out.with_suffix(".json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return result


Sample = tuple[str, str, str, float, float]  # source, stage, check, value, limit


def _measure(
    problem: MoEProblem, tested: Backend, notes: list[str], engines: set[str]
) -> Iterator[Sample]:
    """Every check value of `problem` under each source; stages not compared go to `notes`, the
    GEMM engines the tested backend reports to `engines`."""
    inputs = make_inputs(problem)
    golden = ReferenceBackend()
    golden64 = ReferenceBackend(precision=torch.float64)
    ranks = range(problem.topology.size)
    gold = [run_golden(golden, problem, inputs, r) for r in ranks]
    for name, backend in (("golden64", golden64), (tested.name, tested)):
        verdicts = [
            # The bounds are calibrated against fp32 dequant math, so never the bitwise recipe.
            verify_rank(
                problem,
                inputs,
                backend,
                golden,
                r,
                tuple(Mode),
                golden_trace=gold[r],
                gemm_recipe=GemmRecipe.FP32_DEQUANT,
            )  # fmt: skip
            for r in ranks
        ]
        for mode in Mode:
            compared = [
                (res, v.run.golden, v.run.tested[mode]) for v in verdicts for res in v.results[mode]
            ]
            if has_reduce(problem):
                g, t = reduce_traces(problem, [v.run for v in verdicts], mode)
                compared.append((compare_stage(Stage.REDUCE, g, t, problem, mode=mode), g, t))
            for result, golden_trace, other in compared:
                if backend is tested and result.engine is not None:
                    engines.add(result.engine)
                if result.status in (Status.SKIP, Status.ERROR):
                    notes.append(
                        f"{problem.id} {name}/{mode} {result.label}: {result.status}: "
                        f"{result.reason}"
                    )
                    continue
                yield from _samples(f"{name}/{mode}", result, golden_trace, other, problem, mode)


def _samples(
    source: str,
    result: StageResult,
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    mode: Mode,
) -> Iterator[Sample]:
    """The check values of one compared stage, plus the worst element's excess ratio."""
    for c in result.checks:
        yield source, result.stage, c.name, float(c.value), float(c.limit)
    limits = policy_for(result.stage, problem, mode).limits()
    keyed = all(c.name != "row map" for c in result.checks)
    if "atol" not in limits or "rtol" not in limits or not keyed:
        return  # no per-element bound, or compare could not key every row (its checks say why)
    a, b = keyed_values(result.stage, golden, other, problem, mode)
    a, b = a.cpu(), b.cpu()
    ratio = excess_ratio(a, b, limits["atol"].value, limits["rtol"].value, row_max(b))
    worst = float(ratio.nan_to_num(nan=math.inf).max()) if ratio.numel() else 0.0
    yield source, result.stage, EXCESS, worst, 1.0


# E8M0 cost ---------------------------------------------------------------------------------------


def _e8m0_costs(case: MoEProblem, seed: int, costs: dict[str, E8M0Cost]) -> None:
    """The golden's output of `case` (one rank) under each scale format of its recipe vs the
    master-weight MoE; a format already measured for this seed (by another case) is skipped."""
    fmts = case.recipe.allowed_scale_fmts
    family = case.replace(scale_fmt=fmts[0], topology=Topology()).id
    for fmt in fmts:
        base = case.replace(scale_fmt=fmt, topology=Topology())
        cost = costs.setdefault(base.id, E8M0Cost(base.id, family, case.recipe.value, fmt.value))
        if seed in cost.calc_diff:
            continue
        problem = base.replace(seed=seed)
        inputs = make_inputs(problem)
        trace = ReferenceBackend().run(problem, inputs)
        out = trace["gather"]["out"].detach().cpu().double()
        route = trace["route"]
        master = (
            master_moe(problem, inputs, route["topk_ids"], route["topk_weights"]).cpu().double()
        )
        cost.calc_diff[seed] = calc_diff(out, master)
        cost.rel_l2[seed] = float((out - master).norm() / master.norm())
        cost.row_err[seed] = float(row_rel_error(out, master)[0].max())


# Rendering ---------------------------------------------------------------------------------------


def _stage_rank(stage: str) -> int:
    return _STAGE_ORDER.get(stage, len(_STAGE_ORDER))


def _order(m: Measurement) -> tuple[object, ...]:
    return (m.source, m.case, _stage_rank(m.stage), m.check)


def _fraction(value: float, limit: float) -> float:
    if value == 0:
        return 0.0
    return value / limit if limit > 0 else math.inf


def _finite(x: float) -> float | str:
    """JSON has no inf/nan: write them as strings."""
    return x if math.isfinite(x) else str(x)


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}"


def _pct(m: Measurement) -> str:
    h = m.headroom
    if not math.isfinite(h):
        return "**over (limit 0)**"
    text = f"{100 * h:.1f}%"
    return f"**{text}**" if h > 1 else text


def _environment() -> dict[str, object]:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton_version,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cpu_threads": torch.get_num_threads(),
    }


def _markdown(r: CalibrationResult) -> Iterator[str]:
    env = r.environment
    where = env["device"]
    if env["triton_interpret"]:
        where = f"{where} (Triton interpreter)"
    yield "# Noise-floor calibration"
    yield ""
    yield (
        f"Measured {env['date']} at commit {env['commit'] or 'unknown'} on {where}, "
        f"{env['cpu_threads']} torch threads, torch {env['torch']}, triton {env['triton']}; "
        f"tested backend `{r.backend}` (engine "
        f"`{r.engine}`); {r.seeds} seed(s) per case; {r.seconds.get('total', 0):g} s in all."
    )
    yield f"Regenerate: `moe-verify calibrate --seeds {r.seeds} --out {r.out or 'FILE.md'}`."
    yield ""
    yield (
        "Sources: `golden64/*` is the golden with fp64 GEMM accumulation against the fp32 golden "
        "(the golden's own floor); "
        f"`{r.backend}/isolated` and `{r.backend}/chained` are the tested backend as `verify` "
        "compares it. Value: the largest over seeds (and ranks); headroom = value / limit, the "
        "share of the policy limit the noise already uses (bold: over the limit). "
        f"`{EXCESS}` is the worst element's |a-b| / (atol x rowmax + rtol x |golden|) under the "
        "stage's atol/rtol, limit 1."
    )
    yield ""
    yield "## Closest to the limit, per source, stage and check"
    yield ""
    yield "| source | stage | check | value | limit | headroom | case (worst seed) |"
    yield "| --- | --- | --- | --- | --- | --- | --- |"
    for m in r.worst():
        where = f"{m.case} (s{m.worst_seed})" if m.value else "every case 0"
        yield (
            f"| {m.source} | {m.stage} | {m.check} | {_num(m.value)} | {_num(m.limit)} | "
            f"{_pct(m)} | {where} |"
        )
    yield ""
    yield from _e8m0_markdown(r)
    yield from _exact_markdown(r)
    for source in r.sources():
        yield f"## {source}: every case"
        yield ""
        yield "| case | stage | check | value | limit | headroom |"
        yield "| --- | --- | --- | --- | --- | --- |"
        for m in r.measurements:
            if m.source == source and m.bounded:
                yield (
                    f"| {m.case} | {m.stage} | {m.check} | {_num(m.value)} | {_num(m.limit)} | "
                    f"{_pct(m)} |"
                )
        yield ""
    yield "## Not measured"
    yield ""
    yield from (f"- {n}" for n in r.notes) if r.notes else iter(["- nothing: every stage ran"])
    yield ""
    yield "## Time per case (all seeds, all sources) and the GEMM engines the tested side ran"
    yield ""
    yield "| case | seconds | engines |"
    yield "| --- | --- | --- |"
    for case, s in r.seconds.items():
        yield f"| {case} | {s:g} | {', '.join(r.engines.get(case, [])) or '-'} |"


def _e8m0_markdown(r: CalibrationResult) -> Iterator[str]:
    yield "## Accuracy cost of the scale format (golden output vs bf16 master-weight MoE)"
    yield ""
    yield (
        "The golden's output of each case under every scale format of its recipe, one rank, "
        "against a bf16 MoE on the unquantized master weights (fp32 math, bf16 activations). "
        "rel L2 = ||out - master|| / ||master||; token err = the worst token's max|out - master| "
        "/ rowmax|master|. Mean and max over seeds; x float32 = mean calc_diff over that of "
        "float32 scales on the same case."
    )
    yield ""
    yield (
        "| case | scale_fmt | calc_diff mean | calc_diff max | rel L2 mean | rel L2 max | "
        "token err max | x float32 |"
    )
    yield "| --- | --- | --- | --- | --- | --- | --- | --- |"
    plain = {
        c.family: _mean(c.calc_diff)
        for c in r.e8m0
        if c.scale_fmt == ScaleFmt.FLOAT32.value and c.calc_diff
    }
    for c in r.e8m0:
        if not c.calc_diff:
            continue
        ref = plain.get(c.family)
        ratio = f"{_mean(c.calc_diff) / ref:.2f}" if ref else "-"
        yield (
            f"| {c.case} | {c.scale_fmt} | {_num(_mean(c.calc_diff))} | "
            f"{_num(max(c.calc_diff.values()))} | {_num(_mean(c.rel_l2))} | "
            f"{_num(max(c.rel_l2.values()))} | {_num(max(c.row_err.values()))} | {ratio} |"
        )
    yield ""


def _mean(values: dict[int, float]) -> float:
    return sum(values.values()) / len(values)


def _exact_markdown(r: CalibrationResult) -> Iterator[str]:
    exact = [m for m in r.measurements if not m.bounded]
    broken = [m for m in exact if m.value != 0]
    cases = len({m.case for m in exact})
    yield "## Exact checks (limit 0)"
    yield ""
    yield (
        f"{len(exact)} exact checks (route ids, quant_input codes, align, permute, NaN/Inf, "
        f"contract) over {cases} cases x {r.seeds} seed(s) x {len(r.sources())} sources: "
        + ("all 0." if not broken else f"{len(broken)} nonzero:")
    )
    for m in broken:
        yield f"- {m.source} {m.case} {m.stage} {m.check}: {_num(m.value)} (seed {m.worst_seed})"
    yield ""
