"""Which releases of an engine its adapter runs, and the evidence admitting each (docs/engines.md).

An adapter admits the installed release when one of these holds:

- **tier**: it is a release whose engine tier (`pytest -m vllm`, `-m sglang`, `-m lmdeploy`) passed,
  recorded with where it ran, and its kernel sources are that release's (their sha256 equal the
  recorded ones);
- **identical kernels**: its kernel sources equal, file for file, those of a release whose tier
  passed. This is computed when the adapter loads, so a later release (or a local build) whose
  kernel files did not change is admitted without a change here, and the message says on whose
  evidence.

The kernel sources are the files the adapter calls into: the module of each name it calls and
the files it compiles helpers from (each adapter's `WINDOW.sources`), hashed where they are
installed, without importing them. Anything else is refused with a message naming the release,
the window and the one opt-in, `MOE_VERIFY_<ENGINE>_UNTESTED=1`; a release older than the layout
the adapter knows (`oldest`) is refused even then. An opted-in release runs untested: its stages
are matched against every legitimate recipe instead of declaring one.

The recorded evidence is data, `releases.json` beside this module: per engine and release, where
the tier passed and the digest of every kernel source (null where the release has no such file).
`moe-verify engines --digests ENGINE` prints the installed release's entry for a maintainer to
record once its tier has passed.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

Unavailable = type[Exception]
RECORDS = Path(__file__).with_name("releases.json")
# relpath -> sha256 hex, None where the release has no such file
Digests = Mapping[str, str | None]


class EvidenceKind(enum.Enum):
    TIER = "tier"
    IDENTICAL_KERNELS = "identical kernels"
    OPTED_IN = "opted in"


@dataclass(frozen=True)
class TierRun:
    """A release whose engine tier passed: where, and the digests of its kernel sources."""

    release: str
    where: str
    sources: Digests


@dataclass(frozen=True)
class Evidence:
    """Why the adapter runs the installed `release`: a tier run (`basis` is the tier's release),
    or the opt-in (`basis` None)."""

    kind: EvidenceKind
    release: str
    basis: TierRun | None = None
    env: str = ""

    @property
    def tested(self) -> bool:
        """Admitted on evidence, not opted in: the adapter declares the recipes it knows."""
        return self.kind is not EvidenceKind.OPTED_IN

    def __str__(self) -> str:
        if self.kind is EvidenceKind.TIER:
            assert self.basis is not None
            return f"its tier passed ({self.basis.where})"
        if self.kind is EvidenceKind.IDENTICAL_KERNELS:
            assert self.basis is not None
            return (
                f"kernel sources identical to {self.basis.release}'s, whose tier passed "
                f"({self.basis.where})"
            )
        return f"untested, run because {self.env}=1 is set"


@dataclass(frozen=True)
class ReleaseWindow:
    """The releases of one engine its adapter admits (see the module docstring).

    `sources` are paths relative to the installed `package`'s directory; `oldest` and `too_old`
    bound the layout the adapter knows (refused even when opted in)."""

    engine: str  # as messages name it: "vLLM"
    key: str  # its entry in releases.json, its pip name and its CLI name: "vllm"
    package: str
    dists: tuple[str, ...]  # the distributions that install `package`, the first found read
    sources: tuple[str, ...]
    untested_env: str
    oldest: tuple[int, ...] | None = None
    too_old: str = ""
    # releases seen to have a tier's kernel sources (listed, and installed by `engines --run`)
    records: Mapping[str, Mapping[str, object]] = field(default_factory=dict)

    @property
    def tiers(self) -> tuple[TierRun, ...]:
        """The releases whose tier passed, newest first."""
        runs = [
            TierRun(release, str(entry["tier"]), dict(entry["sources"]))  # type: ignore[call-overload]
            for release, entry in self.records.items()
            if "tier" in entry
        ]
        return tuple(sorted(runs, key=lambda r: release_numbers(r.release), reverse=True))

    @property
    def identical(self) -> dict[str, str]:
        """Releases recorded as having a tier release's kernel sources -> that release (checked
        again whenever the adapter loads them)."""
        return {
            release: str(entry["identical_to"])
            for release, entry in self.records.items()
            if "identical_to" in entry
        }

    def releases(self) -> list[str]:
        """Every release of the window (tier runs and recorded identical ones), newest first."""
        return sorted(self.records, key=release_numbers, reverse=True)

    def describe(self) -> str:
        """One line: the tier releases, and what else is admitted."""
        tiers = ", ".join(t.release for t in self.tiers)
        return (
            f"{self.engine} releases whose tier passed ({tiers}), and any release whose "
            f"{len(self.sources)} kernel source files are identical to one of theirs"
        )


def recorded(key: str) -> dict[str, Mapping[str, object]]:
    """releases.json's entries for engine `key`: release -> {tier, sources} or {identical_to}."""
    return dict(_records().get(key, {}))


@functools.cache
def _records() -> dict[str, dict[str, Mapping[str, object]]]:
    return json.loads(RECORDS.read_text())


def module_source(module: str) -> str:
    """The path of a module's file relative to its top-level package's directory."""
    return "/".join(module.split(".")[1:]) + ".py"


_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(.*)")


def release_numbers(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of '0.32.0', '0.33.0.dev12+g1234abc', '0.5.23+cu129' (patch 0 if
    absent); ValueError for a version without them."""
    m = _VERSION.match(version)
    if m is None:
        raise ValueError(version)
    return int(m[1]), int(m[2]), int(m[3] or 0)


def is_release_of(version: str, release: str) -> bool:
    """`version` is `release` itself or a local build of it ('0.32.0+cpu'), not a pre-release,
    dev or post build around it."""
    m = _VERSION.match(version)
    return (
        m is not None
        and release_numbers(version) == release_numbers(release)
        and (m[4] == "" or m[4].startswith("+"))
    )


def source_digests(root: Path, sources: tuple[str, ...]) -> dict[str, str | None]:
    """sha256 of each of `sources` under `root` (None where the file does not exist)."""
    out: dict[str, str | None] = {}
    for rel in sources:
        path = root / rel
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return out


def opted_in(env: str, environ: Mapping[str, str] = os.environ) -> bool:
    """The user set `env` (to anything but 0) to run a release outside the window."""
    return environ.get(env, "0") not in ("", "0")


def admit(
    window: ReleaseWindow,
    version: str,
    root: Path,
    unavailable: Unavailable,
    environ: Mapping[str, str] = os.environ,
) -> Evidence:
    """The evidence that admits `version` (installed at `root`), or `unavailable` saying why not
    and how to opt in."""
    try:
        numbers = release_numbers(version)
    except ValueError:
        raise unavailable(f"cannot read {window.engine}'s version {version!r}") from None
    if window.oldest is not None and numbers < window.oldest:
        raise unavailable(f"{window.engine} {version} is too old: {window.too_old}")
    installed = source_digests(root, window.sources)
    for tier in window.tiers:
        if installed == dict(tier.sources):
            kind = (
                EvidenceKind.TIER
                if is_release_of(version, tier.release)
                else EvidenceKind.IDENTICAL_KERNELS
            )
            return Evidence(kind, version, tier)
    if opted_in(window.untested_env, environ):
        return Evidence(EvidenceKind.OPTED_IN, version, env=window.untested_env)
    raise unavailable(refusal(window, version, installed))


def refusal(window: ReleaseWindow, version: str, installed: Digests) -> str:
    """Why `version` is refused: the window, the files that differ from the nearest tier
    release's, and the opt-in."""
    tiers = window.tiers
    same = next((t for t in tiers if is_release_of(version, t.release)), None)
    nearest = same or min(tiers, key=lambda t: len(_differing(installed, t.sources)), default=None)
    why = ""
    if nearest is not None:
        files = ", ".join(
            f"{k} (not installed)" if installed.get(k) is None else k
            for k in _differing(installed, nearest.sources)
        )
        whose = "the recorded ones" if same else f"those of {nearest.release} (the nearest)"
        why = f" Its kernel sources differ from {whose} in {files}."
    return (
        f"{window.engine} {version} is outside the adapter's window: {window.describe()}.{why} "
        f"Its kernels may have changed their contract; set {window.untested_env}=1 to run it "
        "anyway (untested: no recipe is declared, each stage is matched against every "
        "legitimate one, and a stage whose kernel lacks what it passes is skipped). "
        "docs/engines.md says how a release joins the window"
    )


def _differing(installed: Digests, recorded_sources: Digests) -> list[str]:
    keys = sorted(set(installed) | set(recorded_sources))
    return [k for k in keys if installed.get(k) != recorded_sources.get(k)]
