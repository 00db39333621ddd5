"""`moe-verify engines`: the flags and the command (moe_verify/engines/ holds the rest).

- `moe-verify engines [ENGINE...]`: each engine's window (its releases, the evidence for each),
  and the release installed here: admitted on what, or refused why. `--json` for machines.
- `moe-verify engines --run [ENGINE...]`: every release of the window, installed and checked
  (moe_verify/engines/run.py); exit 0 when every release behaved as recorded, else 1.
- `moe-verify engines --digests ENGINE`: the releases.json entry for the installed release.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_verify.args import EXIT_FAIL, EXIT_PASS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", nargs="*", help="vllm | sglang | lmdeploy (default: all three)")
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--run",
        action="store_true",
        help="install every release of each window (pip --no-deps --target, over this "
        "environment's dependencies) and run the engine's checks on it; one verdict line each",
    )
    what.add_argument(
        "--digests",
        action="store_true",
        help="print the releases.json entry (kernel source digests) of the installed release",
    )
    what.add_argument("--json", action="store_true", help="the windows as JSON")
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="with --run: where releases are installed and kept (default: engines/ under "
        "$MOE_VERIFY_CACHE_DIR, else ~/.cache/moe-verify/jit)",
    )
    p.add_argument(
        "--out",
        default="moe-verify-engines",
        metavar="DIR",
        help="with --run: each release's sweep summaries (DIR/ENGINE-RELEASE)",
    )
    p.add_argument("--jobs", type=int, default=None, metavar="N", help="with --run: sweep workers")


def cmd_engines(args: argparse.Namespace) -> int:
    from moe_verify.engines.window import describe, digests, engine_keys, table

    keys = engine_keys(args.engine)
    if args.digests:
        if len(keys) != 1:
            raise ValueError("engines --digests: name one engine (vllm, sglang or lmdeploy)")
        print(json.dumps(digests(keys[0]), indent=2))
        return EXIT_PASS
    if args.json:
        print(json.dumps({key: describe(key) for key in keys}, indent=2))
        return EXIT_PASS
    if not args.run:
        print("\n".join(table(key) for key in keys))
        return EXIT_PASS
    from moe_verify.args import check_output_dir
    from moe_verify.common.jit_cache import cache_root
    from moe_verify.engines.run import run_windows

    check_output_dir("--out", args.out)
    cache = Path(args.cache_dir) if args.cache_dir else cache_root() / "engines"
    verdicts = run_windows(keys, cache, Path(args.out), args.jobs)
    failed = [v for v in verdicts if not v.passed]
    print(f"{len(verdicts) - len(failed)} of {len(verdicts)} releases behaved as recorded")
    return EXIT_FAIL if failed else EXIT_PASS
