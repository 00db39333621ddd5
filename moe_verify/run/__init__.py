"""One case: verify and replay, the options, inputs, protection of what a stage is handed, poison,
pre-flight, dumps, metamorphic pairs, the SM90-chain golden choice, workspaces and containment."""
