"""What an engine tier concludes from running an entry's check on the installed release.

The check says whether the entry was observed (a defect reproduced, a control held) and what it
saw. `judge` holds that against the registry: an observation on a release the registry lists is a
pass; anything else is a message telling the maintainer what to record, so the registry's release
lists stay facts from runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_verify.findings.registry import Finding, Kind


@dataclass(frozen=True)
class Observation:
    """One run of an entry's check: `seen` (a defect reproduced, a control held) and what the
    run showed, in words (stages, checks, values)."""

    seen: bool
    detail: str


def judge(finding: Finding, release: str, obs: Observation) -> str | None:
    """None when the run agrees with the registry on `release`; otherwise what to do."""
    listed_seen = release in finding.seen_in
    listed_fixed = release in finding.fixed_in
    if obs.seen and listed_seen or not obs.seen and listed_fixed:
        return None
    what = "reproduces" if finding.kind is Kind.DEFECT else "holds"
    saw = f" (the check saw: {obs.detail})"
    if listed_seen:
        return (
            f"{finding.label} is listed as seen in {finding.engine_name} {release} but no longer "
            f"{what} there: the check or the registry is wrong{saw}"
        )
    if listed_fixed:
        return (
            f"{finding.label} is recorded as fixed in {finding.engine_name} {release} but {what} "
            f"there: the check or the registry is wrong{saw}"
        )
    if obs.seen:
        return f"{finding.label} also seen in {release}: add it to the registry{saw}"
    if finding.kind is Kind.DEFECT:
        return f"{finding.label} fixed in {release}?: record it{saw}"
    return f"{finding.label} no longer holds in {release}: a regression? record it{saw}"
