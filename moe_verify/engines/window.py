"""Each engine's release window as this environment sees it (`moe-verify engines`): the releases
the adapter admits and on what evidence (moe_verify/adapters/releases.py), and the release
installed here with the evidence that admits it or why it is refused. Nothing here imports an
engine: admission reads the installed kernel sources, it does not load them.

`digests` is the maintainer's half: the entry releases.json needs for the installed release.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from moe_verify.adapters.common import package_dir
from moe_verify.adapters.releases import ReleaseWindow, source_digests
from moe_verify.run.runner import ADAPTERS


def engine_keys(names: list[str] | None = None) -> list[str]:
    """The engines `names` asks for (all of them when empty), checked."""
    unknown = [n for n in names or () if n not in ADAPTERS]
    if unknown:
        raise ValueError(f"engines: expected some of {', '.join(ADAPTERS)}, got {unknown}")
    return list(names or ADAPTERS)


def adapter(key: str) -> tuple[ModuleType, type[Exception]]:
    """The adapter module of engine `key` and its "cannot load here" exception."""
    module_name, _, unavailable = ADAPTERS[key]
    module = importlib.import_module(f"moe_verify.adapters.{module_name}")
    return module, getattr(module, unavailable)


def window(key: str) -> ReleaseWindow:
    window: ReleaseWindow = adapter(key)[0].WINDOW
    return window


@dataclass(frozen=True)
class Here:
    """The engine installed in this environment: its release (None: not installed), whether the
    adapter admits it, and the evidence or the refusal."""

    installed: str | None
    admitted: bool
    detail: str


def here(key: str) -> Here:
    module, unavailable = adapter(key)
    try:
        installed = module.installed_version()
    except unavailable as exc:
        return Here(None, False, str(exc))
    try:
        evidence = module.check_version(installed)
    except unavailable as exc:
        return Here(installed, False, str(exc))
    return Here(installed, True, str(evidence))


def describe(key: str) -> dict[str, Any]:
    """The window of `key` and what is installed here, as `engines --json` prints it."""
    w, h = window(key), here(key)
    tiers = {t.release: t.where for t in w.tiers}
    releases = [
        {
            "release": release,
            "evidence": "tier" if release in tiers else "identical kernels",
            "where": tiers.get(release)
            or f"kernel sources identical to {w.identical[release]}'s (recorded; the adapter "
            "compares them again whenever it loads this release)",
        }
        for release in w.releases()
    ]
    return {
        "engine": w.engine,
        "releases": releases,
        "opt_in": f"{w.untested_env}=1",
        "oldest": ".".join(map(str, w.oldest)) if w.oldest else None,
        "installed": h.installed,
        "admitted": h.admitted,
        "detail": h.detail,
    }


def table(key: str) -> str:
    """`moe-verify engines`' lines for `key`."""
    d = describe(key)
    floor = f"; releases before {d['oldest']} are refused even then" if d["oldest"] else ""
    lines = [f"{d['engine']} (outside the window: {d['opt_in']} runs a release untested{floor})"]
    width = max(len(r["release"]) for r in d["releases"]) if d["releases"] else 0
    for r in d["releases"]:
        mark = "*" if r["release"] == d["installed"] else " "
        lines.append(f" {mark}{r['release']:<{width}}  {r['evidence']}: {r['where']}")
    if d["installed"] is None:
        lines.append("  here: not installed")
    else:
        verdict = "admitted" if d["admitted"] else "refused"
        lines.append(f"  here: {d['installed']}, {verdict}: {d['detail']}")
    return "\n".join(lines)


def digests(key: str) -> dict[str, Any]:
    """releases.json's entry for the installed release of `key`: the digest of every kernel
    source, and a `tier` to fill in with where its tier passed."""
    w = window(key)
    module, unavailable = adapter(key)
    version = module.installed_version()
    root = package_dir(w.package, unavailable)
    entry = {
        "tier": f"<where and when the -m {key} tier passed on {w.engine} {version}>",
        "sources": source_digests(root, w.sources),
    }
    return {key: {version: entry}}
