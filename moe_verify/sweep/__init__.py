"""Many cases: the presets (smoke, nightly), the pool of worker processes, each case's containment,
junit and summaries."""
