"""The evidence that admits an engine release (moe_verify/adapters/releases.py), on a fake engine
whose kernel sources are files in a temporary directory: a tier release, a release with a tier
release's sources, a changed source, a tier release modified in place, the opt-in, a release
too old, and how the installed release is read (the dist-info first on sys.path)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from moe_verify.adapters import common
from moe_verify.adapters.releases import (
    EvidenceKind,
    ReleaseWindow,
    admit,
    is_release_of,
    release_numbers,
    source_digests,
)

pytestmark = pytest.mark.cpu

SOURCES = ("kernels/moe.py", "kernels/quant.py", "helpers/later.py")
OPT_IN = "MOE_VERIFY_FAKE_UNTESTED"
WHERE = "the fake tier, 2026-12-05"


class FakeUnavailable(RuntimeError):
    pass


def write(root: Path, moe: str = "moe v1", quant: str = "quant v1", later: str | None = None):
    """A release's kernel sources under `root` (`later` None: a file the release lacks)."""
    for rel, text in zip(SOURCES, (moe, quant, later), strict=True):
        if text is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    return root


@pytest.fixture
def window(tmp_path: Path) -> ReleaseWindow:
    """Tiers passed on 1.2.0 (no helpers/later.py) and 1.4.0 (it has one); 1.1.0 is recorded as
    having 1.2.0's sources."""
    old = source_digests(write(tmp_path / "tier-1.2.0"), SOURCES)
    new = source_digests(write(tmp_path / "tier-1.4.0", quant="quant v2", later="x"), SOURCES)
    return ReleaseWindow(
        engine="Fake",
        key="fake",
        package="fake",
        dists=("fake",),
        sources=SOURCES,
        untested_env=OPT_IN,
        oldest=(1, 0),
        too_old="before 1.0 the kernels lived in another module",
        records={
            "1.2.0": {"tier": WHERE, "sources": old},
            "1.4.0": {"tier": "the fake tier on 1.4.0", "sources": new},
            "1.1.0": {"identical_to": "1.2.0"},
        },
    )


def _admit(window: ReleaseWindow, version: str, root: Path, env: dict[str, str] | None = None):
    return admit(window, version, root, FakeUnavailable, env or {})


@pytest.mark.parametrize("version", ["1.2.0", "1.2.0+cu129", "1.2"])
def test_a_tier_release_is_admitted_on_its_tier(
    window: ReleaseWindow, tmp_path: Path, version: str
) -> None:
    evidence = _admit(window, version, write(tmp_path / "installed"))
    assert evidence.kind is EvidenceKind.TIER and evidence.tested
    assert evidence.basis is not None and evidence.basis.release == "1.2.0"
    assert str(evidence) == f"its tier passed ({WHERE})"


@pytest.mark.parametrize("version", ["1.3.0", "1.2.1.dev4+g123abc", "1.2.0rc1", "1.1.0"])
def test_a_tier_releases_kernel_sources_admit_another_release(
    window: ReleaseWindow, tmp_path: Path, version: str
) -> None:
    """Computed from the files at load time: a dev build or a later release whose kernel files
    did not change is admitted on 1.2.0's tier, and says so."""
    evidence = _admit(window, version, write(tmp_path / "installed"))
    assert evidence.kind is EvidenceKind.IDENTICAL_KERNELS and evidence.tested
    assert evidence.release == version
    assert str(evidence) == f"kernel sources identical to 1.2.0's, whose tier passed ({WHERE})"


def test_a_file_the_tier_release_lacked_must_be_absent_too(
    window: ReleaseWindow, tmp_path: Path
) -> None:
    """1.4.0 has helpers/later.py, 1.2.0 has not: each matches its own set of files."""
    newer = write(tmp_path / "installed", quant="quant v2", later="x")
    assert _admit(window, "1.5.0", newer).basis.release == "1.4.0"  # type: ignore[union-attr]
    (newer / "helpers/later.py").unlink()
    with pytest.raises(
        FakeUnavailable, match=r"\(the nearest\) in helpers/later.py \(not installed\)"
    ):
        _admit(window, "1.5.0", newer)


def test_a_changed_kernel_source_is_refused_naming_the_window_and_the_opt_in(
    window: ReleaseWindow, tmp_path: Path
) -> None:
    with pytest.raises(FakeUnavailable) as refused:
        _admit(window, "1.3.0", write(tmp_path / "installed", moe="moe v2"))
    message = str(refused.value)
    assert message.startswith("Fake 1.3.0 is outside the adapter's window: Fake releases whose ")
    assert "tier passed (1.4.0, 1.2.0)" in message
    assert "differ from those of 1.2.0 (the nearest) in kernels/moe.py." in message
    assert f"set {OPT_IN}=1 to run it anyway" in message and "docs/engines.md" in message


def test_a_tier_release_modified_in_place_is_refused(window: ReleaseWindow, tmp_path: Path) -> None:
    """The version alone admits nothing: 1.2.0's files edited are not the files its tier ran."""
    with pytest.raises(FakeUnavailable, match=r"differ from the recorded ones in kernels/quant.py"):
        _admit(window, "1.2.0", write(tmp_path / "installed", quant="quant, patched"))


def test_the_opt_in_runs_a_release_outside_the_window_untested(
    window: ReleaseWindow, tmp_path: Path
) -> None:
    changed = write(tmp_path / "installed", moe="moe v9")
    with pytest.raises(FakeUnavailable):
        _admit(window, "2.0.0", changed, {OPT_IN: "0"})
    evidence = _admit(window, "2.0.0", changed, {OPT_IN: "1"})
    assert evidence.kind is EvidenceKind.OPTED_IN and not evidence.tested
    assert evidence.basis is None and str(evidence) == f"untested, run because {OPT_IN}=1 is set"


def test_the_opt_in_does_not_replace_evidence(window: ReleaseWindow, tmp_path: Path) -> None:
    """A release with evidence is admitted on it, opt-in or not (its recipes stay declared)."""
    evidence = _admit(window, "1.2.0", write(tmp_path / "installed"), {OPT_IN: "1"})
    assert evidence.kind is EvidenceKind.TIER


def test_a_release_too_old_is_refused_even_when_opted_in(
    window: ReleaseWindow, tmp_path: Path
) -> None:
    with pytest.raises(FakeUnavailable, match="Fake 0.9.3 is too old: before 1.0 the kernels"):
        _admit(window, "0.9.3", write(tmp_path / "installed"), {OPT_IN: "1"})


def test_an_unreadable_version_is_refused(window: ReleaseWindow, tmp_path: Path) -> None:
    with pytest.raises(FakeUnavailable, match="cannot read Fake's version 'main'"):
        _admit(window, "main", write(tmp_path / "installed"), {OPT_IN: "1"})


def test_the_window_lists_its_releases_newest_first(window: ReleaseWindow) -> None:
    assert window.releases() == ["1.4.0", "1.2.0", "1.1.0"]
    assert [t.release for t in window.tiers] == ["1.4.0", "1.2.0"]
    assert window.identical == {"1.1.0": "1.2.0"}


@pytest.mark.parametrize(
    ("version", "release", "same"),
    [
        ("0.32.0", "0.32.0", True),
        ("0.32.0+cpu", "0.32.0", True),  # a local build of the release
        ("0.32", "0.32.0", True),
        ("0.32.1", "0.32.0", False),
        ("0.33.0.dev12+g1234abc", "0.33.0", False),  # a dev build before 0.33.0
        ("0.33.0rc1", "0.33.0", False),
        ("0.33.0.post1", "0.33.0", False),
    ],
)
def test_a_version_is_a_release_only_as_built_from_it(version: str, release: str, same: bool):
    assert is_release_of(version, release) is same
    assert release_numbers(version)[:2] == release_numbers(release)[:2]


def _fake_dist(site: Path, version: str) -> Path:
    """A site directory with the distribution fakeengine `version` and its package."""
    info = site / f"fakeengine-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakeengine\nVersion: {version}\n")
    (site / "fakeengine").mkdir()
    (site / "fakeengine" / "__init__.py").write_text(f"VERSION = {version!r}\n")
    return site


def test_the_release_first_on_the_path_is_the_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How `pip install --target DIR` + PYTHONPATH=DIR puts a release first (.ci/run, `engines
    --run`): its dist-info is the version read, its package the directory hashed."""
    target, site = _fake_dist(tmp_path / "target", "2.0.0"), _fake_dist(tmp_path / "site", "1.0.0")
    monkeypatch.setattr(sys, "path", [str(target), str(site), *sys.path])
    importlib.invalidate_caches()
    assert common.installed_version(("fakeengine",), FakeUnavailable, "absent") == "2.0.0"
    assert common.package_dir("fakeengine", FakeUnavailable) == target / "fakeengine"
    monkeypatch.setattr(sys, "path", [str(site), str(target), *sys.path[2:]])
    importlib.invalidate_caches()
    assert common.installed_version(("fakeengine",), FakeUnavailable, "absent") == "1.0.0"
    assert common.package_dir("fakeengine", FakeUnavailable) == site / "fakeengine"
    with pytest.raises(FakeUnavailable, match="absent"):
        common.installed_version(("nosuchengine",), FakeUnavailable, "absent")
