"""Production mode: the CUDA-graph replay (`moe-verify graph`), the stage and production
benchmarks, their targets and reports, the host-read counter."""
