"""Pictures and error maps of a verified case."""
