"""`moe-verify engines`: the windows as listed here, `--digests` (what a maintainer records) and
`--run` (each release installed with pip --no-deps --target, loaded in a child with that target
first on PYTHONPATH, its checks judged), with the children and pip stood in except where a test
runs pip itself on a local wheel."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from moe_verify.adapters import lmdeploy, vllm
from moe_verify.adapters.releases import Evidence, EvidenceKind, ReleaseWindow, admit
from moe_verify.cli import main
from moe_verify.engines import checks, run, window

pytestmark = pytest.mark.cpu


def _out(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> str:
    assert main(["engines", *argv]) == code
    return capsys.readouterr().out


def test_engines_lists_each_window_and_what_is_installed_here(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """LMDeploy 0.17.0 installed (admitted on 0.18.0's sources), vLLM 0.35.0 whose kernel
    sources match no tier's (none are at tmp_path)."""
    tier = lmdeploy.WINDOW.tiers[0]
    monkeypatch.setattr(lmdeploy, "installed_version", lambda: "0.17.0")
    monkeypatch.setattr(
        lmdeploy,
        "check_version",
        lambda v: Evidence(EvidenceKind.IDENTICAL_KERNELS, v, tier),
    )
    monkeypatch.delenv(vllm.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "installed_version", lambda: "0.35.0")
    checked = vllm.check_version
    monkeypatch.setattr(vllm, "check_version", lambda v: checked(v, root=tmp_path))
    text = _out(capsys)
    assert text.startswith("vLLM (outside the window: MOE_VERIFY_VLLM_UNTESTED=1 runs a release")
    assert "  0.34.0  tier: " in text and "  0.32.0  tier: .ci/run step 2" in text
    assert "  here: 0.35.0, refused: vLLM 0.35.0 is outside the adapter's window" in text
    assert " *0.17.0  identical kernels: kernel sources identical to 0.18.0's" in text
    assert "  here: 0.17.0, admitted: kernel sources identical to 0.18.0's, whose tier" in text


def test_engines_json_names_each_release_and_its_evidence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shown = json.loads(_out(capsys, "lmdeploy", "--json"))
    entry = shown["lmdeploy"]
    assert [(r["release"], r["evidence"]) for r in entry["releases"]] == [
        ("0.18.0", "tier"),
        ("0.17.0", "identical kernels"),
    ]
    assert entry["opt_in"] == "MOE_VERIFY_LMDEPLOY_UNTESTED=1" and entry["oldest"] is None
    assert set(entry) == {
        "engine",
        "releases",
        "opt_in",
        "oldest",
        "installed",
        "admitted",
        "detail",
    }


def test_an_unknown_engine_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engines", "trtllm"]) == 2
    assert (
        "engines: expected some of vllm, sglang, lmdeploy, got ['trtllm']"
        in capsys.readouterr().err
    )


def test_digests_prints_the_entry_that_admits_the_release_it_came_from(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fake lmdeploy 0.19.0 (some of its kernel sources, a dist-info) first on sys.path: the
    printed entry holds each source's sha256 (null where absent), and a window recording it
    admits that release on its tier."""
    site = tmp_path / "site"
    info = site / "lmdeploy-0.19.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmdeploy\nVersion: 0.19.0\n")
    root = site / "lmdeploy"
    for rel in lmdeploy.WINDOW.sources[:3]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "lmdeploy", raising=False)
    importlib.invalidate_caches()
    entry = json.loads(_out(capsys, "lmdeploy", "--digests"))["lmdeploy"]["0.19.0"]
    assert entry["tier"].startswith("<where and when the -m lmdeploy tier passed")
    assert list(entry["sources"]) == list(lmdeploy.WINDOW.sources)
    assert [d is None for d in entry["sources"].values()] == [False] * 3 + [True] * 3
    entry["tier"] = "recorded here"
    recorded = ReleaseWindow(**{**vars(lmdeploy.WINDOW), "records": {"0.19.0": entry}})
    evidence = admit(recorded, "0.19.0", root, RuntimeError, {})
    assert evidence.kind is EvidenceKind.TIER and str(evidence) == "its tier passed (recorded here)"


def test_digests_needs_one_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engines", "--digests"]) == 2
    assert "name one engine" in capsys.readouterr().err


# -- --run, with pip and the children stood in ---------------------------------------------------


class Children:
    """Stands in for `_child`: records each command and its environment, answers like the real
    children would for a child that loaded `loaded` (admitted or not) and a sweep whose
    summary.json is `summary` (None: it wrote none)."""

    def __init__(self, key: str, loaded: str, admitted: bool = True, summary: Any = "clean"):
        self.key, self.loaded, self.admitted = key, loaded, admitted
        self.summary = _clean(key) if summary == "clean" else summary
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, env))
        if "engines" in argv:
            seen = {"installed": self.loaded, "admitted": self.admitted, "detail": "the evidence"}
            return subprocess.CompletedProcess(argv, 0, json.dumps({self.key: seen}), "")
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        if self.summary is not None:
            (out / "summary.json").write_text(json.dumps(self.summary))
        return subprocess.CompletedProcess(argv, 1, "", "a sweep's last words")


def _clean(key: str) -> dict[str, Any]:
    cases = []
    for case in checks.CHECKS[key].cases:
        report = {
            mode: [
                {"stage": s, "status": "fail" if s in case.failing(mode) else "pass"}
                for s in ("route", "permute", "act_quant", "gather")
            ]
            for mode in checks.MODES
        }
        cases.append({"id": case.problem.id, "status": "PASS", "report": report})
    return {"cases": cases}


@pytest.fixture
def installs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    done: list[str] = []

    def install(key: str, release: str, cache: Path) -> Path:
        done.append(release)
        return cache / f"{key}-{release}"

    monkeypatch.setattr(run, "install", install)
    return done


def test_a_release_is_installed_loaded_first_on_the_path_and_judged(
    installs: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    children = Children("lmdeploy", "0.17.0")
    monkeypatch.setattr(run, "_child", children)
    monkeypatch.setenv("PYTHONPATH", "/the/suite")
    monkeypatch.setenv(lmdeploy.UNTESTED_ENV, "1")
    verdict = run.check_release("lmdeploy", "0.17.0", tmp_path / "cache", tmp_path, None, False)
    assert verdict.passed, verdict.detail
    assert verdict.detail == "the evidence; 2 cases as recorded" and installs == ["0.17.0"]
    assert verdict.line().startswith("PASS LMDeploy 0.17.0: the evidence; 2 cases as recorded (")
    (engines, env), (sweep, _) = children.calls
    assert engines[-3:] == ["engines", "lmdeploy", "--json"]
    assert sweep[3:] == [
        "sweep", "--preset", "engine-lmdeploy", "--backend", "lmdeploy", "--mode", "both",
        "--out", str(tmp_path / "lmdeploy-0.17.0"),
    ]  # fmt: skip
    target = str(tmp_path / "cache" / "lmdeploy-0.17.0")
    assert env["PYTHONPATH"] == os.pathsep.join([target, "/the/suite"])
    assert lmdeploy.UNTESTED_ENV not in env  # admitted on its evidence, not the opt-in


def test_the_release_installed_here_runs_in_place(
    installs: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    children = Children("lmdeploy", "0.18.0")
    monkeypatch.setattr(run, "_child", children)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    verdict = run.check_release("lmdeploy", "0.18.0", tmp_path, tmp_path, 3, in_place=True)
    assert verdict.passed and installs == []
    (_, env), (sweep, _) = children.calls
    assert "PYTHONPATH" not in env and sweep[-2:] == ["--jobs", "3"]


@pytest.mark.parametrize(
    ("children", "says"),
    [
        (Children("lmdeploy", "0.18.0"), "the child loaded LMDeploy 0.18.0, not 0.17.0"),
        (Children("lmdeploy", "0.17.0", admitted=False), "refused: the evidence"),
        (Children("lmdeploy", "0.17.0", summary=None), "the sweep wrote no summary (exit 1): a"),
        (Children("lmdeploy", "0.17.0", summary={"cases": []}), ": did not run;"),
    ],
    ids=["another-release", "refused", "no-summary", "judged"],
)
def test_a_release_that_does_not_behave_as_recorded_fails(
    children: Children, says: str, installs: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setattr(run, "_child", children)
    verdict = run.check_release("lmdeploy", "0.17.0", tmp_path, tmp_path, None, False)
    assert not verdict.passed and says in verdict.detail, verdict.detail
    assert verdict.line().startswith("FAIL LMDeploy 0.17.0: ")


def test_run_checks_every_release_of_the_window_and_fails_if_one_does(
    installs: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(window, "here", lambda key: window.Here("0.18.0", True, ""))
    monkeypatch.setattr(run, "here", window.here)
    loads = iter(["0.18.0", "0.18.0"])  # the second release loads the wrong one

    def child(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return Children("lmdeploy", next(loads) if "engines" in argv else "")(argv, env)

    monkeypatch.setattr(run, "_child", child)
    out = _out(capsys, "lmdeploy", "--run", "--cache-dir", "c", "--out", "o", code=1)
    lines = out.splitlines()
    assert lines[0].startswith("PASS LMDeploy 0.18.0: the evidence; 2 cases as recorded")
    assert lines[1].startswith("FAIL LMDeploy 0.17.0: the child loaded LMDeploy 0.18.0")
    assert lines[2] == "1 of 2 releases behaved as recorded" and installs == ["0.17.0"]


# -- install: pip itself, on a local wheel --------------------------------------------------------


def _wheel(where: Path, name: str, version: str) -> Path:
    info = f"{name}-{version}.dist-info"
    path = where / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", "")
        whl.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        whl.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{info}/RECORD", "")
    return path


def _need_pip() -> None:
    """Skip unless pip is installed, without importing it: on Python < 3.12 an import of pip (or
    a find_spec of it) switches setuptools' distutils shim off for the process, and the next
    torch.compile on the CPU then fails in `import setuptools` (AssertionError naming the stdlib
    distutils/core.py) in whichever test of this xdist worker compiles first."""
    try:
        importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip is not installed: the install runs pip in a child")


def test_the_pip_check_leaves_pip_unimported() -> None:
    _need_pip()
    assert "pip" not in sys.modules


def test_install_puts_the_release_in_the_cache_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_pip()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "fakeengine", "0.1.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    target = run.install("fakeengine", "0.1.0", tmp_path / "cache")
    assert target == tmp_path / "cache" / "fakeengine-0.1.0"
    assert (target / "fakeengine" / "__init__.py").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["fakeengine-0.1.0"]

    def no_pip(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        raise AssertionError(f"pip ran again: {argv}")

    monkeypatch.setattr(run, "_child", no_pip)
    assert run.install("fakeengine", "0.1.0", tmp_path / "cache") == target


def test_a_failed_install_says_so_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_pip()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"pip install --no-deps fakeengine==0.2.0 failed: "):
        run.install("fakeengine", "0.2.0", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
