"""How an engine tier reads its check against the registry (moe_verify/findings/verdict.py):
every combination of listed release and observation, for a defect and a control."""

from __future__ import annotations

import dataclasses

import pytest

from moe_verify.findings.registry import Kind, finding
from moe_verify.findings.verdict import Observation, judge

pytestmark = pytest.mark.cpu

DEFECT = dataclasses.replace(finding(1), seen_in=("0.32.0",), fixed_in=("0.40.0",))
CONTROL = dataclasses.replace(finding(2), seen_in=("0.5.23",))
SEEN, GONE = Observation(True, "crashed at align"), Observation(False, "passed")

# (entry, installed release, observation, None or the words the message must hold)
CASES = [
    (DEFECT, "0.32.0", SEEN, None),  # listed, reproduces
    (DEFECT, "0.34.0", SEEN, "finding 1 also seen in 0.34.0: add it to the registry"),
    (DEFECT, "0.34.0", GONE, "finding 1 fixed in 0.34.0?: record it"),
    (DEFECT, "0.32.0", GONE, "listed as seen in vLLM 0.32.0 but no longer reproduces"),
    (DEFECT, "0.40.0", GONE, None),  # recorded as fixed, and it is
    (DEFECT, "0.40.0", SEEN, "recorded as fixed in vLLM 0.40.0 but reproduces"),
    (CONTROL, "0.5.23", SEEN, None),
    (CONTROL, "0.5.24", SEEN, "finding 2 also seen in 0.5.24: add it to the registry"),
    (CONTROL, "0.5.24", GONE, "finding 2 no longer holds in 0.5.24: a regression?"),
    (CONTROL, "0.5.23", GONE, "listed as seen in SGLang 0.5.23 but no longer holds"),
]


@pytest.mark.parametrize(
    ("entry", "release", "obs", "says"),
    CASES,
    ids=[f"{e.kind}-{r}-{'seen' if o.seen else 'gone'}" for e, r, o, _ in CASES],
)
def test_judge(entry, release: str, obs: Observation, says: str | None) -> None:
    verdict = judge(entry, release, obs)
    if says is None:
        assert verdict is None, verdict
    else:
        assert verdict is not None and says in verdict, verdict
        assert obs.detail in verdict  # what the check saw travels with the message


def test_kinds_are_the_two() -> None:
    assert {DEFECT.kind, CONTROL.kind} == set(Kind)
