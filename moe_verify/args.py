"""Command-line vocabulary shared by `moe-verify` and the torchrun worker: exit codes, the problem
and backend flags, the flags of `run`, and the problem and run options they describe
(`problem_from_args`, `run_options`; `run_flags` is the way back, for the torchrun ranks), and
the writing of the files they name (`write_output`)."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from moe_verify.common.loader import class_spec
from moe_verify.run.contain import DEFAULT_CASE_TIMEOUT_S
from moe_verify.run.options import RunOptions, check_invariance, is_instance
from moe_verify.spec import (
    EXIT_CODES,
    MODE_CHOICES,
    Engine,
    GemmRecipe,
    GroupedLayout,
    MoEProblem,
    Recipe,
    RouterWeight,
    Routing,
    ScaleFmt,
    Status,
)
from moe_verify.spec import check_output_dir as check_output_dir  # the CLI's, one implementation
from moe_verify.spec import check_output_file as check_output_file

# 0 every check passed, 1 a check failed, 2 an error (bad arguments, crash, missing dependency, a
# timeout, or nothing verified); 130 interrupted (Ctrl-C) and 143 terminated (SIGTERM), as shells
# report those signals.
EXIT_PASS, EXIT_FAIL, EXIT_ERROR = (EXIT_CODES[s] for s in (Status.PASS, Status.FAIL, Status.ERROR))
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
# compute-sanitizer's tools that `run --sanitize` takes (moe_verify/sanitize/run.py).
SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")


def seconds(text: str) -> float:
    """--case-timeout: a finite number of seconds >= 0 (0: no limit)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds >= 0 (0: no limit), got {text!r}"
        )
    return value


def byte(text: str) -> int:
    """--poison: one byte, decimal or 0x-hex (255, 0xFF, 0)."""
    try:
        value = int(text, 0)
    except ValueError:
        value = -1
    if not 0 <= value <= 0xFF:
        raise argparse.ArgumentTypeError(f"expected a byte 0..255 or 0x00..0xFF, got {text!r}")
    return value


def invariance(text: str) -> str:
    """--invariance: a setting `run` can pair (run/options.py check_invariance)."""
    try:
        return check_invariance(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("invariance: ")) from None


def add_problem_args(p: argparse.ArgumentParser) -> None:
    """The MoEProblem's fields as flags, defaulting to MoEProblem()'s."""
    d = MoEProblem()
    p.add_argument("--tokens", "-T", type=int, default=d.tokens)
    p.add_argument("--hidden", "-H", type=int, default=d.hidden)
    p.add_argument("--intermediate", "-I", type=int, default=d.intermediate)
    p.add_argument("--num-experts", "-E", type=int, default=d.num_experts)
    p.add_argument("--topk", "-k", type=int, default=d.topk)
    p.add_argument("--recipe", choices=[r.value for r in Recipe], default=d.recipe.value)
    p.add_argument(
        "--scale-fmt",
        choices=[f.value for f in ScaleFmt],
        default=None,
        help="default: the recipe's first allowed format",
    )
    p.add_argument(
        "--activation", default="silu", help="silu | silu:L<limit> | swigluoai[:alpha:beta:limit]"
    )
    p.add_argument("--routing", choices=[r.value for r in Routing], default=d.routing.value)
    p.add_argument(
        "--topology", default="tp:1", help="tp:N | ep:N | ep:N:round_robin | ep:N+ht | ep:N+ll"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--alignment", type=int, default=d.alignment)
    p.add_argument("--provenance", action="store_true")
    p.add_argument("--no-renormalize", action="store_true")
    p.add_argument("--routed-scaling-factor", type=float, default=d.routed_scaling_factor)
    p.add_argument("--num-expert-group", type=int, default=d.num_expert_group)
    p.add_argument("--topk-group", type=int, default=d.topk_group)
    p.add_argument(
        "--shared-experts",
        type=int,
        default=d.shared_experts,
        help="DeepSeek-style shared experts added to the routed output",
    )
    p.add_argument(
        "--grouped-layout",
        choices=[g.value for g in GroupedLayout],
        default=d.grouped_layout.value,
        help="the grouped GEMMs' layout: per-row m_indices, per-expert psum ends, per-expert "
        "batches (masked: dispatch instead of align and permute, in any topology), or as vLLM "
        "picks (ep:N+ll: masked)",
    )
    p.add_argument(
        "--ll-capacity",
        type=int,
        default=d.ll_capacity,
        metavar="ROWS",
        help="the masked layout (ep:N+ll, --grouped-layout masked): rows of each expert's batch "
        "(ep:N+ll: DeepEP's max_tokens), a multiple of 128 "
        "(default 0: the tokens rounded up to 128-row blocks)",
    )
    p.add_argument(
        "--tiny-tokens",
        type=int,
        default=d.tiny_tokens,
        metavar="N",
        help="rescale the first N tokens to |max| 2^-119, so every MXFP8 group of them has E8M0 "
        "scale byte 0 (2^-127; Triton #11624 decoded it as zero)",
    )
    p.add_argument(
        "--router-weight",
        choices=[r.value for r in RouterWeight],
        default=d.router_weight.value,
        help="where the top-k router weight is applied: in the gather's weighted sum, or on the "
        "input before quantization (vLLM's apply_router_weight_on_input; -k 1 with "
        "--no-renormalize)",
    )


def add_backend_args(p: argparse.ArgumentParser, modes: bool = True) -> None:
    """--backend and --engine (and --mode unless `modes` is False)."""
    p.add_argument(
        "--backend",
        default="optimized",
        help="optimized | golden | vllm (docs/vllm.md) | sglang (docs/sglang.md) | lmdeploy "
        "(docs/implementations.md) | module:Class (your own Backend)",
    )
    p.add_argument(
        "--engine",
        default=Engine.AUTO.value,
        choices=[e.value for e in Engine],
        help="GEMM engine of the optimized backend",
    )
    if modes:
        p.add_argument("--mode", default="both", choices=MODE_CHOICES)


def add_run_args(run: argparse.ArgumentParser) -> None:
    """The flags of `moe-verify run`, which the torchrun worker takes too."""
    add_problem_args(run)
    add_backend_args(run)
    run.add_argument("--json", help="write the report as JSON here")
    run.add_argument("--markdown", help="write the report as markdown here")
    run.add_argument(
        "--dump-dir", help="on failure, dump inputs and every trace here (for `replay`)"
    )
    add_case_timeout_arg(run)
    add_plot_arg(run)
    run.add_argument(
        "--workspace",
        action="store_true",
        help="the optimized backend reuses its output buffers across calls, as vLLM's "
        "workspaces are, with canary guard bands checked after every stage",
    )
    run.add_argument(
        "--poison",
        type=byte,
        action="append",
        metavar="BYTE",
        help="fill the optimized backend's buffers with this byte before each use (0xFF, 255, "
        "0); twice for a two-poison run, whose two runs must also agree bit for bit",
    )
    run.add_argument(
        "--poison-padding",
        action="store_true",
        help="isolated mode: the golden's padding rows (permute; ep:N+ll: the batches past "
        "masked_m) hold the largest e4m3 code, and the largest scale where the layout leaves "
        "padding scales unspecified, so a GEMM that lets padding reach live rows fails "
        "(FlashInfer #3650); chained mode is unaffected",
    )
    run.add_argument(
        "--gemm-recipe",
        choices=[r.value for r in GemmRecipe],
        default=None,
        help="what gemm1/gemm2 are held to; default: bit for bit to the golden's tensor-core "
        "recipe where the stage ran DeepGEMM on SM90 (isolated on the same operands; chained "
        "against the golden's SM90 chain, every stage bit for bit), else bounded against fp32 "
        "dequant math; tensor_core: bit for bit always (fp8_block, fp32 or ceil-UE8M0 scales); "
        "fp32_dequant: bounded always",
    )
    run.add_argument(
        "--invariance",
        default=None,
        type=invariance,
        metavar="KIND",
        help="alignment | m_sum | ll_capacity | expected_m | num_sms: run the tested side a "
        "second time with only this setting changed (alignment 64 vs 128; upper-bound vs exact "
        "M_sum; the ep:N+ll batch capacity doubled; DeepGEMM's expected_m or SM count): every "
        "stage must also agree bit for bit between the two runs",
    )
    run.add_argument(
        "--strict", action="store_true", help="a skipped stage fails the run too (exit 1)"
    )
    run.add_argument(
        "--verbose", "-v", action="store_true", help="every check of every stage, not a line each"
    )
    run.add_argument(
        "--problem-json",
        help="read the whole problem from this JSON file "
        "(MoEProblem.to_dict); the problem flags are then ignored",
    )
    run.add_argument(
        "--launcher",
        choices=["none", "torchrun"],
        default="none",
        help="none: emulate every rank in this process; torchrun: one process per rank, the real "
        "collective (NCCL on GPUs, gloo on the CPU), see moe_verify/distributed/",
    )
    run.add_argument(
        "--nproc", type=int, default=None, help="torchrun processes (default and only value: ranks)"
    )
    run.add_argument(
        "--sanitize",
        choices=SANITIZER_TOOLS,
        default=None,
        metavar="TOOL",
        help="run the case in a subprocess under compute-sanitizer (memcheck | racecheck | "
        "initcheck | synccheck) and report its first error with kernel, stage and case, and "
        "how much slower it ran (docs/sanitize.md)",
    )
    run.add_argument(
        "--compare-on",
        choices=["golden", "cpu"],
        default="golden",
        help="where stages are compared: the golden's device (a GPU run is compared on the GPU), "
        "or the CPU, which spends no GPU memory on comparisons but copies every stage to the host",
    )


def add_case_timeout_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--case-timeout",
        type=seconds,
        default=DEFAULT_CASE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a case still running after this long is an error naming the stage in flight "
        f"(default {DEFAULT_CASE_TIMEOUT_S:g}; 0: no limit)",
    )


def add_plot_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plot", metavar="DIR", help="write a heatmap of each failing stage's error here"
    )


def write_output(flag: str, path: str | None, text: Callable[[], str]) -> None:
    """The output file `flag` names (--json, --markdown), written after the report was printed
    (its path was checked before the run), ending with a newline as a text file does; an
    OSError there, a full disk say, names the flag and the path."""
    if path is None:
        return
    body = text()
    try:
        Path(path).write_text(body if body.endswith("\n") else body + "\n")
    except OSError as exc:
        raise OSError(f"{flag} {path}: not written after the run ({exc})") from exc


def problem_from_args(args: argparse.Namespace) -> MoEProblem:
    """The problem the flags describe, or the one --problem-json holds."""
    if getattr(args, "problem_json", None):
        path = Path(args.problem_json)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"--problem-json {path}: {exc.strerror or exc}") from exc
        except ValueError as exc:  # not UTF-8, or not JSON
            raise ValueError(f"--problem-json {path}: not a JSON file ({exc})") from exc
        try:
            return MoEProblem.from_dict(data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"--problem-json {path}: expected MoEProblem.to_dict()'s fields, got "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    recipe = Recipe(args.recipe)
    try:
        return _problem(args, recipe)
    except (TypeError, ValueError) as exc:  # the flag's name, not the field's
        raise ValueError(_FIELD.sub(lambda m: _flag(m.group(1)), str(exc))) from exc


# 'MoEProblem.tokens' in a problem's message; the short flags of add_problem_args.
_FIELD = re.compile(r"MoEProblem\.(\w+)")
_SHORT = {"tokens": "-T", "hidden": "-H", "intermediate": "-I", "num_experts": "-E", "topk": "-k"}


def _flag(field: str) -> str:
    """'-T/--tokens': the flag of `run` that sets the problem's `field`."""
    long = "--no-renormalize" if field == "renormalize" else f"--{field.replace('_', '-')}"
    return f"{_SHORT[field]}/{long}" if field in _SHORT else long


def _problem(args: argparse.Namespace, recipe: Recipe) -> MoEProblem:
    return MoEProblem(
        tokens=args.tokens,
        hidden=args.hidden,
        intermediate=args.intermediate,
        num_experts=args.num_experts,
        topk=args.topk,
        recipe=recipe,
        scale_fmt=args.scale_fmt or recipe.allowed_scale_fmts[0],
        activation=args.activation,
        routing=args.routing,
        topology=args.topology,
        seed=args.seed,
        alignment=args.alignment,
        provenance=args.provenance,
        renormalize=not args.no_renormalize,
        routed_scaling_factor=args.routed_scaling_factor,
        num_expert_group=args.num_expert_group,
        topk_group=args.topk_group,
        shared_experts=args.shared_experts,
        grouped_layout=args.grouped_layout,
        ll_capacity=args.ll_capacity,
        tiny_tokens=args.tiny_tokens,
        router_weight=args.router_weight,
    )


# The run options a command's flags set: argparse's dest -> RunOptions' field.
_OPTION_DESTS = {
    "backend": "backend",
    "engine": "engine",
    "mode": "mode",
    "workspace": "workspace",
    "poison": "poison",
    "poison_padding": "padding_poison",
    "gemm_recipe": "gemm_recipe",
    "compare_on": "compare_device",
    "case_timeout": "case_timeout_s",
    "dump_dir": "dump_dir",
    "plot": "plot_dir",
    "invariance": "invariance",
}


def run_options(args: argparse.Namespace) -> RunOptions:
    """The RunOptions of a command's flags (`run`'s, `sweep`'s, the torchrun worker's), built
    once and checked before any work; an option the command has no flag for keeps RunOptions'
    default. --compare-on golden is the golden's device (None), --case-timeout 0 no limit."""
    given = vars(args)
    fields = {field: given[dest] for dest, field in _OPTION_DESTS.items() if dest in given}
    if "compare_device" in fields:
        fields["compare_device"] = "cpu" if fields["compare_device"] == "cpu" else None
    return RunOptions(**fields)


def run_flags(options: RunOptions) -> list[str]:
    """The flags of `moe-verify run` that `run_options` reads back as `options` (the torchrun
    launcher starts its ranks with them); a ValueError for what no flag can say: a backend
    instance, a comparison device other than the golden's or the CPU."""
    if is_instance(options.backend):
        raise ValueError(f"backend {options.backend!r}: a flag names a backend, not an instance")
    if options.compare_device not in (None, "cpu"):
        raise ValueError(
            f"compare_device {options.compare_device!r}: --compare-on takes golden or cpu only"
        )
    backend = options.backend if isinstance(options.backend, str) else class_spec(options.backend)
    flags = ["--backend", backend, "--engine", options.engine.value, "--mode", options.mode]
    flags += ["--case-timeout", str(options.case_timeout_s or 0)]
    if options.workspace:
        flags.append("--workspace")
    for byte in options.poison:
        flags += ["--poison", str(byte)]
    if options.padding_poison:
        flags.append("--poison-padding")
    if options.gemm_recipe is not None:
        flags += ["--gemm-recipe", options.gemm_recipe.value]
    if options.compare_device == "cpu":
        flags += ["--compare-on", "cpu"]
    if options.dump_dir is not None:
        flags += ["--dump-dir", str(options.dump_dir)]
    if options.plot_dir is not None:
        flags += ["--plot", str(options.plot_dir)]
    if options.invariance is not None:
        flags += ["--invariance", options.invariance]
    return flags
