"""What the suite found in the engines' kernels, as data (registry), how an engine tier judges a
run against it (verdict), how `moe-verify findings` prints it (table) and `moe-verify repro`'s
standalone reproductions (repro, standalone). docs/implementations.md tells each finding's story;
docs/repro.md the repro's."""
