"""RunOptions (moe_verify/run/options.py): each field checked with an error naming it and the value,
the combinations that would be ignored refused, the JSON round trip (through a real dump and
`replay`), the flags round trip of the torchrun ranks, and what each launcher refuses."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from moe_verify.args import add_run_args, run_flags, run_options
from moe_verify.run import verify as verification
from moe_verify.run.dump import load_case
from moe_verify.run.options import FLAGS, RunOptions, options_of
from moe_verify.run.verify import replay, verify
from moe_verify.spec import Engine, GemmRecipe, Mode, MoEProblem
from optimized.backend import OptimizedBackend

pytestmark = pytest.mark.cpu

PROBLEM = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)
WRONG = "tests.tester.wrong_backends:MisroutedToken"  # fails at route: a dump is written


# -- each field, and the combinations ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "exc", "words"),
    [
        ({"backend": "optimised"}, ValueError, "backend: expected 'optimized', 'golden', 'vllm'"),
        ({"backend": 3}, TypeError, "backend: expected a name, 'module:Class'"),
        ({"mode": "sideways"}, ValueError, "mode: expected 'isolated', 'chained' or 'both', got"),
        ({"mode": Mode}, TypeError, "mode: expected"),
        ({"engine": "cuda"}, ValueError, "engine must be one of 'auto', 'deepgemm', 'triton'"),
        ({"workspace": "yes"}, TypeError, "workspace: expected True or False, got 'yes'"),
        ({"poison": 300}, ValueError, "poison: expected a byte in 0..255, got 300"),
        ({"poison": [True]}, ValueError, "poison: expected a byte in 0..255, got True"),
        ({"poison": (1, 1)}, ValueError, "poison: a two-poison run needs two different bytes"),
        ({"poison": (1, 2, 3)}, ValueError, "poison: expected one or two bytes, got 3"),
        ({"poison": 1.5}, TypeError, "poison: expected a byte or a list"),
        ({"padding_poison": 1}, TypeError, "padding_poison: expected True or False, got 1"),
        ({"gemm_recipe": "fp16"}, ValueError, "gemm_recipe must be one of"),
        ({"compare_device": "gpu0"}, ValueError, "compare_device: expected a device"),
        ({"compare_device": 0}, TypeError, "compare_device: expected a device"),
        ({"case_timeout_s": -1}, ValueError, "case_timeout_s: expected >= 0 (0: no limit), got -1"),
        ({"case_timeout_s": math.inf}, ValueError, "case_timeout_s: expected >= 0"),
        ({"case_timeout_s": "5"}, TypeError, "case_timeout_s: expected seconds"),
        ({"dump_dir": 3}, TypeError, "dump_dir: expected a directory path, got 3"),
        ({"plot_dir": ""}, ValueError, "plot_dir: expected a directory path, got ''"),
        ({"invariance": "capacity"}, ValueError, "invariance: expected one of"),
        ({"invariance": "poison"}, ValueError, "--workspace --poison A --poison B"),
        # combinations
        (
            {"mode": "chained", "padding_poison": True},
            ValueError,
            "padding_poison: it poisons the golden's upstream, which only isolated mode feeds",
        ),
        (
            {"invariance": "alignment", "dump_dir": "d", "padding_poison": True},
            ValueError,
            "--dump-dir, --poison-padding: not supported with --invariance",
        ),
    ],
    ids=lambda v: "+".join(v) if isinstance(v, dict) else "",
)
def test_a_bad_field_is_refused_naming_it_and_its_value(
    fields: dict, exc: type[Exception], words: str
) -> None:
    with pytest.raises(exc) as raised:
        RunOptions(**fields)
    assert words in str(raised.value)


def test_fields_are_normalized_once() -> None:
    options = RunOptions(
        engine="triton",
        poison=0xFF,
        case_timeout_s=0,
        compare_device=torch.device("cpu"),
        dump_dir="dumps",
        gemm_recipe="tensor_core",
        mode=Mode.CHAINED,
    )
    assert options.engine is Engine.TRITON and options.poison == (0xFF,)
    assert options.case_timeout_s is None  # 0: no limit
    assert options.compare_device == "cpu" and options.dump_dir == Path("dumps")
    assert options.gemm_recipe is GemmRecipe.TENSOR_CORE
    assert options.mode == "chained" and type(options.mode) is str
    assert RunOptions(mode="both").modes == (Mode.ISOLATED, Mode.CHAINED)
    assert RunOptions(poison=None).poison == () == RunOptions(poison=[]).poison
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.mode = "both"  # type: ignore[misc]


# -- JSON ----------------------------------------------------------------------------------------

EVERY_FIELD = RunOptions(
    backend=WRONG,
    mode="both",
    engine="triton",
    workspace=True,
    poison=(0xFF, 0),
    padding_poison=True,
    gemm_recipe="fp32_dequant",
    compare_device="cpu",
    case_timeout_s=12.5,
    dump_dir="dumps",
    plot_dir="plots",
)


def test_every_field_round_trips_through_json() -> None:
    data = json.loads(json.dumps(EVERY_FIELD.to_dict()))
    assert set(data) == set(FLAGS)  # every field is written
    assert RunOptions.from_dict(data) == EVERY_FIELD
    alignment = RunOptions(mode="both", invariance="alignment")
    assert RunOptions.from_dict(alignment.to_dict()) == alignment


def test_a_backend_class_or_instance_is_written_as_its_module_and_class() -> None:
    spec = "optimized.backend:OptimizedBackend"
    assert RunOptions(OptimizedBackend).to_dict()["backend"] == spec
    assert RunOptions(OptimizedBackend(engine="triton")).to_dict()["backend"] == spec
    assert RunOptions.from_dict(RunOptions(OptimizedBackend).to_dict()).backend == spec


def test_an_older_version_s_run_json_reads_with_the_rest_at_their_defaults() -> None:
    older = {"backend": WRONG, "engine": "triton", "mode": "isolated", "workspace": False,
             "poison": [], "padding_poison": True, "gemm_recipe": None}  # fmt: skip
    options = RunOptions.from_dict(older)
    assert options == RunOptions(WRONG, "isolated", engine="triton", padding_poison=True)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([], "expected a JSON object of run options, got list"),
        ({"backend": "optimized", "colour": "red"}, "unknown run option(s) ['colour']"),
        ({"mode": "both"}, "'backend' must be a string: the run options record no backend"),
        ({"backend": 1}, "'backend' must be a string, got 1"),
        ({"backend": "optimized", "workspace": "no"}, "'workspace' must be true or false"),
        ({"backend": "optimized", "poison": [300]}, "'poison' must be a list of at most two"),
        ({"backend": "optimized", "case_timeout_s": "9"}, "'case_timeout_s' must be a number"),
        ({"backend": "optimized", "mode": "sideways"}, "mode: expected"),
    ],
    ids=[
        "not-an-object",
        "unknown",
        "no-backend",
        "backend-int",
        "bool",
        "poison",
        "timeout",
        "mode",
    ],  # fmt: skip
)
def test_from_dict_refuses_what_to_dict_never_writes(data: object, words: str) -> None:
    with pytest.raises(ValueError) as raised:
        RunOptions.from_dict(data)
    assert words in str(raised.value)


# -- the call: options, or the keyword arguments it had before -----------------------------------


def test_options_or_keyword_arguments_but_not_both() -> None:
    assert options_of("f", None, {"mode": "both"}, {"case_timeout_s": 5}) == RunOptions(
        mode="both", case_timeout_s=5
    )
    given = RunOptions(mode="chained")
    assert options_of("f", given, {}, {"case_timeout_s": 5}) is given
    with pytest.raises(ValueError, match=r"verify: options=RunOptions\(...\) and the keyword"):
        verify(PROBLEM, mode="both", options=given)
    with pytest.raises(TypeError, match=r"verify: unknown option\(s\) \['colour'\]"):
        verify(PROBLEM, colour="red")
    with pytest.raises(TypeError, match="verify: options: expected a RunOptions, got dict"):
        verify(PROBLEM, options={"mode": "both"})  # type: ignore[arg-type]


def test_a_dump_records_the_options_and_replay_restores_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = RunOptions(
        WRONG, "isolated", engine="triton", compare_device="cpu", case_timeout_s=600,
        dump_dir=tmp_path / "dumps", plot_dir=tmp_path / "plots",
    )  # fmt: skip
    report = verify(PROBLEM, options=options)
    assert report.first_failure == "route"
    case = load_case(tmp_path / "dumps", device="cpu")
    assert case.options == options  # the engine it ran is the one asked for
    # A real replay fails where the run did ...
    assert replay(tmp_path / "dumps").first_failure == "route"
    # ... with every recorded option but the output directories, the given ones replacing theirs.
    seen: list[RunOptions] = []
    real = verification.verify

    def spy(problem: MoEProblem, **kwargs: object):
        seen.append(kwargs["options"])  # type: ignore[arg-type]
        return real(problem, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(verification, "verify", spy)
    replay(tmp_path / "dumps")
    replay(tmp_path / "dumps", backend="optimized", mode="both")
    assert seen[0] == dataclasses.replace(options, dump_dir=None, plot_dir=None)
    assert seen[1] == dataclasses.replace(seen[0], backend="optimized", mode="both")


def test_a_dump_without_its_options_needs_a_backend(tmp_path: Path) -> None:
    verify(PROBLEM, backend=WRONG, mode="isolated", engine="triton", dump_dir=tmp_path)
    (tmp_path / PROBLEM.id / "run.json").unlink()
    assert load_case(tmp_path, device="cpu").options is None
    with pytest.raises(ValueError, match="does not record its backend"):
        replay(tmp_path)
    assert replay(tmp_path, backend=WRONG, engine="triton").first_failure == "route"


# -- flags -------------------------------------------------------------------------------------


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_run_args(parser)
    return parser


def test_run_flags_give_the_options_back_through_run_options() -> None:
    for options in (
        EVERY_FIELD,
        RunOptions(),
        RunOptions(OptimizedBackend, "chained", invariance="m_sum", case_timeout_s=900),
    ):
        back = run_options(_run_parser().parse_args(run_flags(options)))
        spec = options.to_dict()["backend"]  # a class travels as its module:Class
        assert back == dataclasses.replace(options, backend=spec)


def test_run_options_reads_the_cli_s_spellings() -> None:
    args = _run_parser().parse_args(["--compare-on", "golden", "--case-timeout", "0"])
    options = run_options(args)
    assert options.compare_device is None and options.case_timeout_s is None
    assert options.mode == "both"  # the CLI's default, not RunOptions'
    sweep_like = argparse.Namespace(backend="golden", mode="both", engine="auto")
    assert run_options(sweep_like) == RunOptions("golden", "both")  # no flag: the default


def test_what_no_flag_can_say_is_refused() -> None:
    with pytest.raises(ValueError, match="a flag names a backend, not an instance"):
        run_flags(RunOptions(OptimizedBackend(engine="triton")))
    with pytest.raises(ValueError, match="--compare-on takes golden or cpu only"):
        run_flags(RunOptions(compare_device="cuda:1"))


# -- launchers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"workspace": True}, "--workspace"),
        ({"poison": 0}, "--poison"),
        ({"plot_dir": "p"}, "--plot"),
        ({"compare_device": "cpu"}, "--compare-on cpu"),
        ({"invariance": "alignment"}, "--invariance"),
    ],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)
def test_torchrun_refuses_what_its_ranks_do_not_honour(fields: dict, flag: str) -> None:
    options = RunOptions(**fields)
    with pytest.raises(ValueError, match=f"^{flag}: not supported with --launcher torchrun$"):
        options.check_launcher("torchrun")
    options.check_launcher("none")  # in process every option holds
    options.check_launcher("isolated")


def test_torchrun_takes_the_rest_and_names_every_refusal_at_once() -> None:
    RunOptions(
        WRONG, "isolated", engine="triton", padding_poison=True, gemm_recipe="fp32_dequant",
        case_timeout_s=5, dump_dir="d",
    ).check_launcher("torchrun")  # fmt: skip
    with pytest.raises(ValueError, match="^--workspace, --poison: not supported with --launcher"):
        RunOptions(workspace=True, poison=1).check_launcher("torchrun")


def test_an_instance_cannot_cross_into_another_process() -> None:
    options = RunOptions(OptimizedBackend(engine="triton"))
    options.check_launcher("none")
    for launcher in ("isolated", "torchrun"):
        with pytest.raises(ValueError, match="cannot take an instance; pass it by name"):
            options.check_launcher(launcher)
    RunOptions(OptimizedBackend).check_launcher("isolated")  # a class travels by its name
    with pytest.raises(ValueError, match="launcher: expected one of"):
        options.check_launcher("slurm")


def test_the_launchers_check_before_any_work(tmp_path: Path) -> None:
    from moe_verify.distributed.launch import launch
    from moe_verify.sweep.sweep import sweep

    with pytest.raises(ValueError, match="an isolated sweep runs the case in another process"):
        sweep([PROBLEM], backend=OptimizedBackend(engine="triton"), out_dir=tmp_path)
    assert not (tmp_path / "summary.json").exists()
    with pytest.raises(ValueError, match="--workspace: not supported with --launcher torchrun"):
        launch(PROBLEM, RunOptions(workspace=True))
