"""Plumbing every command shares: the device, loading `module:Class`, progress lines, timers, safe
file I/O, DeepGEMM's JIT cache."""
