"""`moe-verify engines`: the engines' release windows (docs/engines.md).

- `window`: each window and the release installed here (`moe-verify engines`, `--digests`);
- `checks`: the cases each release must run, and what each stage must do on them;
- `run`: `--run`, every release of a window installed and checked;
- `command`: the flags.
"""
