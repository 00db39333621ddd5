"""The registry as `moe-verify findings` prints it: a terminal table, JSON, and the markdown table
docs/implementations.md holds (tests/findings/test_docs.py keeps the two equal)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from moe_verify.findings.registry import Finding, Kind

WIDTH = 100
INDENT = "    "


def releases(f: Finding) -> str:
    fixed = f"; fixed in {', '.join(f.fixed_in)}" if f.fixed_in else ""
    return ", ".join(f.seen_in) + fixed


def stages(f: Finding) -> str:
    return ", ".join(f.stages)


def what(f: Finding) -> str:
    """The sentence, a control marked as one (it is not a bug)."""
    return f"(control of finding {f.control_of}) {f.what}" if f.kind is Kind.CONTROL else f.what


def to_text(findings: Sequence[Finding]) -> str:
    """A row an entry (id, engine, releases, stage, upstream), its `what` wrapped below it."""
    head = ("id", "engine", "releases", "stage", "upstream")
    rows = [
        (str(f.id), f.engine, releases(f), stages(f), f.upstream.short() if f.upstream else "-")
        for f in findings
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    lines = [line(head)]
    for cells, f in zip(rows, findings, strict=True):
        lines.append(line(cells))
        lines.extend(
            textwrap.wrap(
                what(f),
                WIDTH,
                initial_indent=INDENT,
                subsequent_indent=INDENT,
                break_on_hyphens=False,
            )
        )
    return "\n".join(lines)


def to_dicts(findings: Sequence[Finding]) -> list[dict[str, Any]]:
    out = []
    for f in findings:
        d = asdict(f)
        d["kind"] = f.kind.value
        d["stages"] = [s.value for s in f.stages]
        if f.upstream is not None:
            d["upstream"]["url"] = f.upstream.url
        out.append(d)
    return out


def to_json(findings: Sequence[Finding]) -> str:
    return json.dumps(to_dicts(findings), indent=2)


def to_markdown(findings: Sequence[Finding]) -> str:
    """The docs' table: finding, engine, seen in, stage, what, upstream (linked)."""
    lines = [
        "| finding | engine | seen in | stage | what | upstream |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in findings:
        up = f"[{f.upstream.short()}]({f.upstream.url})" if f.upstream else "none found"
        if f.kind is Kind.CONTROL:
            up = "n/a (not a bug)"
        cells = (str(f.id), f.engine_name, releases(f), stages(f), what(f), up)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
