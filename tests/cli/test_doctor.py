"""`moe-verify doctor`: torch, triton, DeepGEMM (every field its probe reports but the module)
and each engine adapter: installed release, releases accepted, whether it would run here and why.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType

import pytest

from moe_verify import doctor as doc
from moe_verify.adapters import lmdeploy, sglang, vllm
from moe_verify.cli import main
from moe_verify.run.runner import ADAPTERS
from optimized import deepgemm

pytestmark = pytest.mark.cpu


def _printed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["doctor", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_doctor_names_each_adapter_with_its_releases_and_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = _printed(capsys)
    assert list(report["adapters"]) == list(ADAPTERS) == ["vllm", "sglang", "lmdeploy"]
    for name, entry in report["adapters"].items():
        assert set(entry) == {"installed", "accepts", "runs_here", "detail"}, name
        assert isinstance(entry["runs_here"], bool) and entry["detail"], name
        if entry["installed"] is None:  # this venv: none of the engines (their tiers' venvs have)
            assert not entry["runs_here"] and "not installed" in entry["detail"], entry
    accepts = {name: e["accepts"] for name, e in report["adapters"].items()}
    assert accepts["vllm"].startswith("vLLM releases whose tier passed (0.34.0, 0.33.0, 0.32.0)")
    assert "whose 6 kernel source files are identical to one of theirs; " in accepts["vllm"]
    assert "; releases before 0.20 refused; " in accepts["vllm"]
    assert accepts["sglang"].startswith("SGLang releases whose tier passed (0.5.23, 0.5.20), ")
    assert accepts["lmdeploy"].startswith("LMDeploy releases whose tier passed (0.18.0), and any ")
    for name, text in accepts.items():
        assert text.endswith(f"untested with MOE_VERIFY_{name.upper()}_UNTESTED=1 (not set)")


def test_an_installed_release_the_adapter_refuses_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """vLLM 0.35 installed, its kernel sources changed: the doctor reports the release and the
    adapter's own refusal; with the opt-in, that it runs untested."""
    monkeypatch.delenv(vllm.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "installed_version", lambda: "0.35.0")

    def availability() -> tuple[bool, str]:
        try:
            evidence = vllm.check_version("0.35.0", root=tmp_path)
        except vllm.VllmUnavailable as exc:
            return False, str(exc)
        return True, f"vLLM 0.35.0: {evidence}"

    monkeypatch.setattr(vllm, "availability", availability)
    entry = _printed(capsys)["adapters"]["vllm"]
    assert entry["installed"] == "0.35.0" and entry["runs_here"] is False
    assert "vLLM 0.35.0 is outside the adapter's window" in entry["detail"]
    assert f"set {vllm.UNTESTED_ENV}=1" in entry["detail"]
    monkeypatch.setenv(vllm.UNTESTED_ENV, "1")
    entry = _printed(capsys)["adapters"]["vllm"]
    assert entry["runs_here"] is True and entry["accepts"].endswith("=1 (set)")
    assert entry["detail"] == f"vLLM 0.35.0: untested, run because {vllm.UNTESTED_ENV}=1 is set"


@pytest.mark.parametrize("module", [sglang, lmdeploy], ids=lambda m: m.__name__.split(".")[-1])
def test_a_usable_adapter_is_reported_as_running_here(
    module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(module, "installed_version", lambda: "9.9.9")
    monkeypatch.setattr(module, "availability", lambda: (True, "engine 9.9.9 (a switch)"))
    name = next(n for n, (m, _, _) in ADAPTERS.items() if module.__name__.endswith(m))
    entry = doc.adapter_status(name)
    assert entry["installed"] == "9.9.9" and entry["runs_here"] is True
    assert entry["detail"] == "engine 9.9.9 (a switch)"


def test_deep_gemm_shows_every_field_of_its_status_but_the_module(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A field the probe learns (here `location`) appears without a change to the doctor."""
    wider = dataclasses.make_dataclass(
        "WiderStatus", [("location", "str | None", dataclasses.field(default=None))],
        bases=(deepgemm.DeepGemmStatus,), frozen=True,
    )  # fmt: skip
    status = wider(False, "a reason", "2.7.0", 9, module=json, location="/opt/DeepGEMM")
    monkeypatch.setattr(deepgemm, "probe", lambda: status)
    shown = _printed(capsys)["deep_gemm"]
    fields = {f.name for f in dataclasses.fields(status)}
    assert set(shown) == fields - {"module"} and "location" in shown
    assert shown["location"] == "/opt/DeepGEMM" and shown["version"] == "2.7.0"
    assert "module" not in shown  # a module object is neither JSON nor a user's answer


def test_doctor_runs_from_the_command_line_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    report = _printed(capsys)
    assert {"torch", "cuda", "gpu", "triton", "deep_gemm", "adapters"} <= set(report)
    assert {"usable", "reason", "version"} <= set(report["deep_gemm"])


def test_doctors_json_ends_with_a_newline(capsys: pytest.CaptureFixture[str]) -> None:
    """`moe-verify doctor > f.json; cat f.json` leaves the prompt on its own line."""
    assert main(["doctor"]) == 0
    assert capsys.readouterr().out.endswith("}\n")
