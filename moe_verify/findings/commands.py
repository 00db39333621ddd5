"""`moe-verify findings` (the registry: a table, --json, --markdown, --engine) and `moe-verify
repro` (a standalone script from a finding or a dump), as subcommands of the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_verify.findings import table
from moe_verify.findings.registry import ENGINES, FINDINGS, for_engine
from moe_verify.spec.checks import check_output_dir


def cmd_findings(args: argparse.Namespace) -> int:
    chosen = for_engine(args.engine) if args.engine else FINDINGS
    if args.json:
        print(table.to_json(chosen))
    elif args.markdown:
        print(table.to_markdown(chosen))
    else:
        print(table.to_text(chosen))
    return 0


def cmd_repro(args: argparse.Namespace) -> int:
    from moe_verify.findings import repro

    check_output_dir("--out", args.out)
    if args.finding is not None:
        made = repro.from_finding(args.finding)
    else:
        made = repro.from_dump(Path(args.dump))
    script = repro.write(made, Path(args.out))
    print(made.title)
    print(f"wrote {script} and {script.with_name(repro.INPUTS)} ({len(made.calls)} call(s))")
    print(f"run: python {script}   (exit 1 while the bug is there; docs/repro.md)")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    fi = sub.add_parser("findings", help="what the suite found in the engines' kernels")
    fi.add_argument("--engine", choices=list(ENGINES), default=None, help="one engine's only")
    form = fi.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="every field, as JSON")
    form.add_argument("--markdown", action="store_true", help="the table docs/ holds")
    fi.set_defaults(func=cmd_findings)

    rp = sub.add_parser("repro", help="write a standalone script reproducing an engine bug")
    source = rp.add_mutually_exclusive_group(required=True)
    source.add_argument("--finding", type=int, help="a finding's id (moe-verify findings)")
    source.add_argument(
        "--dump", help="a case dumped by `moe-verify run --backend <engine> --dump-dir`"
    )
    rp.add_argument("--out", required=True, help="directory for repro.py and inputs.safetensors")
    rp.set_defaults(func=cmd_repro)
