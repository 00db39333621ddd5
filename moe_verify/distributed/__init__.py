"""Real multi-process runs: one process per rank under torchrun, the real collective, one report.

`worker.py` is one rank (the torchrun entry point); `launch.py` starts torchrun and names the
ranks that failed. The names below are the protocol between them.
"""

from __future__ import annotations

STATUS_DIR_ENV = "MOE_VERIFY_DIST_DIR"
TIMEOUT_ENV = "MOE_VERIFY_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 900.0
# NVLink multicast stays off, also over a user's environment: it must on the shared multi-GPU
# hosts this suite is verified on (docs/gpu-results.md), and it is not what is verified here.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# A rank that fails before its stages run (inputs, the golden) reports under this stage name.
SETUP_STAGE = "setup"
# A rank's note while it is in the collectives ("exchange: all-reduce", ...).
EXCHANGE = "exchange"
