"""The registry's own consistency (validate, and that it can refuse), that every evidence node id
collects, and that each engine tier has a check for each of its engine's entries."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from moe_verify.findings.registry import (
    ENGINES,
    FINDINGS,
    RETIRED,
    Kind,
    RegistryError,
    finding,
    for_engine,
    validate,
)
from moe_verify.run.runner import ADAPTERS
from moe_verify.spec import Stage

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
ONE = FINDINGS[0]


def test_the_registry_is_valid() -> None:
    validate(FINDINGS)
    assert set(ENGINES) <= set(ADAPTERS), "an engine of the registry has no adapter"


# (what breaks it, the registry, the words the refusal must say)
BROKEN = [
    ("duplicate id", [ONE, ONE], "appear more than once"),
    ("retired id", [dataclasses.replace(ONE, id=next(iter(RETIRED)))], "was retired"),
    ("unknown engine", [dataclasses.replace(ONE, engine="trtllm")], "not one of"),
    ("unknown stage", [dataclasses.replace(ONE, stages=("aling",))], "Stage members"),
    ("no stage", [dataclasses.replace(ONE, stages=())], "Stage members"),
    ("never seen", [dataclasses.replace(ONE, seen_in=())], "seen_in is empty"),
    ("seen and fixed", [dataclasses.replace(ONE, fixed_in=ONE.seen_in[:1])], "both in"),
    ("evidence not a node id", [dataclasses.replace(ONE, evidence=("tests/x.py",))], "node ids"),
    ("no evidence", [dataclasses.replace(ONE, evidence=())], "node ids"),
    ("control without its defect", [dataclasses.replace(ONE, kind=Kind.CONTROL)], "control_of"),
    ("defect naming a control_of", [dataclasses.replace(ONE, control_of=1)], "control_of"),
    ("what not one sentence", [dataclasses.replace(ONE, what="no period")], "one sentence"),
]


@pytest.mark.parametrize(("why", "registry", "says"), BROKEN, ids=[b[0] for b in BROKEN])
def test_validate_refuses(why: str, registry: list, says: str) -> None:
    with pytest.raises(RegistryError, match=says):
        validate(registry)


def test_a_control_names_a_defect() -> None:
    control = next(f for f in FINDINGS if f.kind is Kind.CONTROL)
    of_a_control = dataclasses.replace(control, id=99, control_of=control.id)
    with pytest.raises(RegistryError, match="is not a defect"):
        validate([*FINDINGS, of_a_control])


def test_lookups_name_what_there_is() -> None:
    assert finding(1).engine == "vllm" and finding(1).stages[0] is Stage.ALIGN
    with pytest.raises(ValueError, match="no finding 3 .retired: .*; the registry has 1, 2"):
        finding(3)
    assert [f.id for f in for_engine("lmdeploy")] == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="unknown engine 'trt'"):
        for_engine("trt")


def uncollected(ids: list[str]) -> list[str]:
    """The node ids of `ids` that `pytest --collect-only` does not collect from the checkout."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = set(done.stdout.splitlines()) if done.returncode == 0 else set()
    return [i for i in ids if i not in collected]


def test_every_evidence_node_id_collects() -> None:
    ids = sorted({e for f in FINDINGS for e in f.evidence})
    assert uncollected(ids) == []


def test_a_node_id_that_does_not_collect_is_named() -> None:
    gone = "tests/adapters/test_vllm_graph.py::test_vllm_indexes_by_stale_padding_ids[ep:4]"
    assert uncollected([gone]) == [gone]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_entry_has_a_check_in_its_engine_tier(engine: str) -> None:
    tier = importlib.import_module(f"tests.adapters.test_{engine}_findings")
    assert set(tier.CHECKS) == {f.id for f in for_engine(engine)}
