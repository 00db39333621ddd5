"""`moe-verify repro`'s scripts, run where moe-verify cannot be imported (standalone_env.py), on
kernels written here (correct_kernels.py), no engine needed: exit 0 on a kernel without the bug,
1 on one with it, 2 when they cannot run. From a finding (1 and 6) and from dumps whose backend
is recorded as the engine's (a wrong backend of tests/tester failing at that stage stands in for
the engine, run.json rewritten): the dump's rank, mode and upstream reach the script. The engine
tiers run the same scripts on the engines' kernels (tests/adapters/test_*_findings.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from moe_verify.cli import main
from moe_verify.findings import repro, standalone
from moe_verify.run.dump import RUN_FILE
from tests.findings.standalone_env import run_script

pytestmark = pytest.mark.cpu


def written(source: list[str], out: Path) -> Path:
    assert main(["repro", *source, "--out", str(out)]) == 0
    script = out / repro.SCRIPT
    assert script.read_text() == Path(standalone.__file__).read_text()
    return script


def about(script: Path) -> dict:
    with safe_open(str(script.with_name(repro.INPUTS)), framework="pt") as f:
        return json.loads(f.metadata()["repro"])


# (finding, the kernel, exit code, words the output must hold)
FINDING_RUNS = [
    (1, "count_expert_num_tokens", 0, "right: every count takes only ids in range"),
    (1, "count_wrapping_ids", 1, "WRONG: 1 of 2 counts differ"),
    (1, "count_importing_moe_verify", 2, "import of moe_verify halted"),
    (6, "ep_gather", 0, "0 of 8192 elements beyond 1 bf16 ulp"),
    (6, "ep_gather_bf16", 1, "WRONG: the sum is not the fp32 one rounded once"),
]


@pytest.mark.parametrize(
    ("finding", "kernel", "code", "says"),
    FINDING_RUNS,
    ids=[f"{r[0]}-{r[1]}" for r in FINDING_RUNS],
)
def test_the_repro_of_a_finding(
    finding: int, kernel: str, code: int, says: str, tmp_path: Path
) -> None:
    script = written(["--finding", str(finding)], tmp_path / "repro")
    done = run_script(script, kernel=kernel)
    assert done.returncode == code and says in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("kernel", "code"), [("count_expert_num_tokens", 0), ("count_wrapping_ids", 1)]
)
def test_spawned_children_import_the_kernel_themselves(
    kernel: str, code: int, tmp_path: Path
) -> None:
    """On a GPU each call's child is spawned (CUDA cannot be used in a child forked after the
    parent initialized it, as importing vLLM does): the child imports the kernel by its path."""
    script = written(["--finding", "1"], tmp_path / "repro")
    done = run_script(script, kernel, "--spawn")
    assert done.returncode == code, done.stdout
    assert "cannot judge" not in done.stdout, done.stdout


def test_children_are_spawned_on_a_gpu() -> None:
    assert standalone.start_method(gpu=True, spawn=False) == "spawn"
    assert standalone.start_method(gpu=False, spawn=True) == "spawn"
    assert standalone.start_method(gpu=False, spawn=False) == "fork"


def test_finding_1s_calls_plant_the_stale_ids(tmp_path: Path) -> None:
    calls = about(written(["--finding", "1"], tmp_path / "repro"))["calls"]
    assert list(calls) == ["one_past_the_map", "stale_ids"]
    assert "123456789 and 2071690107" in calls["stale_ids"]["about"]
    assert calls["one_past_the_map"]["map_length"] == 4


def test_a_kernel_that_cannot_be_imported_cannot_run(tmp_path: Path) -> None:
    script = written(["--finding", "6"], tmp_path / "repro")
    done = run_script(script, kernel="no_such_kernel")
    assert done.returncode == 2 and "cannot run: AttributeError" in done.stdout, done.stdout


TINY = ["-T", "8", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]
# wrong backend -> the engine its dump is made to look like (what `run --backend <engine>` records)
STAND_INS = {
    "align": "tests.tester.wrong_backends:ExpertMapIgnoredOnRank1",  # rank 1's counts, global ids
    "gather": "tests.tester.wrong_backends:Bf16GatherAccumulation",
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """stage -> an isolated ep:2 dump failing first at that stage."""
    out = {}
    for stage, backend in STAND_INS.items():
        d = tmp_path_factory.mktemp(f"dump-{stage}")
        run = ["run", *TINY, "--topology", "ep:2", "--mode", "isolated", "--backend", backend]
        assert main([*run, "--dump-dir", str(d)]) == 1
        out[stage] = next(d.iterdir())
    return out


def as_engine(case: Path, engine: str | None, where: Path) -> Path:
    """A copy of `case` under `where` as if `run --backend <engine>` had made it (None: an older
    dump, without run.json)."""
    case = Path(shutil.copytree(case, where / case.name))
    run = case / RUN_FILE
    if engine is None:
        run.unlink()
    else:
        run.write_text(json.dumps({**json.loads(run.read_text()), "backend": engine}))
    return case


# the rank whose stage failed first, as the title names it
RANK = {"align": "rank 1 (isolated)", "gather": "rank 0 (isolated)"}
# (stage, engine, the kernel, exit code, words)
DUMP_RUNS = [
    ("align", "vllm", "count_expert_num_tokens", 0, "right: every count"),
    ("align", "vllm", "count_ignoring_the_map", 1, "WRONG: "),
    ("gather", "lmdeploy", "ep_gather", 0, "0 of 1024 elements beyond 1 bf16 ulp"),
    ("gather", "lmdeploy", "ep_gather_bf16", 1, "WRONG: the sum"),
]


@pytest.mark.parametrize(
    ("stage", "engine", "kernel", "code", "says"), DUMP_RUNS, ids=[r[2] for r in DUMP_RUNS]
)
def test_the_repro_of_a_dump(
    stage: str, engine: str, kernel: str, code: int, says: str, dumps, tmp_path: Path
) -> None:
    case = as_engine(dumps[stage], engine, tmp_path)
    script = written(["--dump", str(case)], tmp_path / "repro")
    assert RANK[stage] in about(script)["title"], about(script)["title"]
    done = run_script(script, kernel=kernel)
    assert done.returncode == code and says in done.stdout, done.stdout


# (stage of the dump, the backend it records, words of the refusal)
REFUSED = [
    ("align", "lmdeploy", "is lmdeploy's align (rank 1, isolated mode); the repro knows how to"),
    ("gather", "sglang", "was made with --backend sglang; the repro calls an engine's kernel"),
    ("gather", "optimized", "was made with --backend optimized"),
    ("gather", None, "no backend recorded (run.json)"),
]


@pytest.mark.parametrize(("stage", "engine", "says"), REFUSED, ids=[str(r[1]) for r in REFUSED])
def test_repro_refuses_a_dump_it_cannot_call(
    stage: str, engine: str | None, says: str, dumps, tmp_path: Path, capsys
) -> None:
    case = as_engine(dumps[stage], engine, tmp_path)
    assert main(["repro", "--dump", str(case), "--out", str(tmp_path / "repro")]) == 2
    err = capsys.readouterr().err
    assert says in err and "vllm align; lmdeploy gather" in err, err
