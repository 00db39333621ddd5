"""The JIT caches every process of a run shares: DeepGEMM's kernels, Triton's, and inductor's.

A cold GPU run spends most of its time compiling (DeepGEMM builds each new GEMM shape with nvcc,
about 9 s each on an H200; Triton and torch.compile compile their kernels at first call). Those
compiles land in three on-disk caches, each named by an environment variable:

| variable                  | what it caches                                              |
| ------------------------- | ----------------------------------------------------------- |
| `DG_JIT_CACHE_DIR`        | DeepGEMM's compiled GEMM kernels                            |
| `TRITON_CACHE_DIR`        | Triton's compiled kernels (ours and inductor's)             |
| `TORCHINDUCTOR_CACHE_DIR` | torch.compile's caches (the golden's tensor-core model)     |

`shared_jit_caches()` sets each one that is unset to a directory under one stable per-user root,
so the workers of a sweep (`moe-verify sweep --jobs N`) and the xdist workers of the GPU test tiers
(conftest.py) all read and write the same caches, and a second run on the same machine starts
warm. The root is `$MOE_VERIFY_CACHE_DIR`, else `$XDG_CACHE_HOME/moe-verify/jit`, else
`~/.cache/moe-verify/jit`. A variable already set is never changed; where the root cannot be
created (a read-only home), nothing is set and each tool keeps its own default. docs/ci.md says
which directories a CI system should keep between runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

# variable -> its directory under the root
CACHE_DIRS = {
    "DG_JIT_CACHE_DIR": "deep_gemm",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
}
ROOT_ENV = "MOE_VERIFY_CACHE_DIR"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """The directory the unset caches go under (see the module docstring)."""
    if environ.get(ROOT_ENV):
        return Path(environ[ROOT_ENV]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "moe-verify" / "jit"


def shared_jit_caches(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set every cache variable of CACHE_DIRS that `environ` lacks (or has empty) to its directory
    under `cache_root` (created here; the tools create their directories in it); return those
    that are set now. Where the root cannot be created, nothing is set."""
    unset = [var for var in CACHE_DIRS if not environ.get(var)]
    if unset:
        root = cache_root(environ)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            unset = []
        for var in unset:
            environ[var] = str(root / CACHE_DIRS[var])
    return {var: environ[var] for var in CACHE_DIRS if environ.get(var)}
