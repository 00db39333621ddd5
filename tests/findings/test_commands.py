"""`moe-verify findings` (table, --json, --markdown, --engine) and `moe-verify repro`'s refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_verify.cli import main
from moe_verify.findings import table
from moe_verify.findings.registry import FINDINGS, for_engine

pytestmark = pytest.mark.cpu


def test_findings_lists_every_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["findings"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["id", "engine", "releases", "stage", "upstream"]
    rows = [line.split()[0] for line in lines if line[:1].isdigit()]
    assert rows == [str(f.id) for f in FINDINGS]
    assert "vllm-project/vllm#50845 (open)" in out and "(control of finding 1)" in out
    assert max(len(line) for line in lines) <= table.WIDTH, out


def test_findings_json_has_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["findings", "--json", "--engine", "vllm"]) == 0
    (one,) = json.loads(capsys.readouterr().out)
    assert one["id"] == 1 and one["stages"] == ["align", "permute"] and one["kind"] == "defect"
    assert one["upstream"]["url"] == "https://github.com/vllm-project/vllm/pull/50845"
    assert one["evidence"] and one["action"] and one["seen_in"]


def test_findings_engine_filter(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["findings", "--engine", "lmdeploy", "--markdown"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == [str(f.id) for f in for_engine("lmdeploy")]
    with pytest.raises(SystemExit, match="2"):  # argparse: not a choice
        main(["findings", "--engine", "tensorrt"])


def test_repro_refuses_a_finding_without_one(tmp_path: Path, capsys) -> None:
    assert main(["repro", "--finding", "4", "--out", str(tmp_path)]) == 2
    assert "no repro for finding 4 (LMDeploy permute) yet; findings with one: 1, 6" in (
        capsys.readouterr().err
    )
    assert main(["repro", "--finding", "3", "--out", str(tmp_path)]) == 2
    assert "no finding 3 (retired:" in capsys.readouterr().err


@pytest.mark.parametrize("source", [[], ["--finding", "1", "--dump", "d"]], ids=["neither", "both"])
def test_repro_takes_one_source(source: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="2"):
        main(["repro", *source, "--out", str(tmp_path)])
