"""compute-sanitizer around one case in a subprocess, and its report."""
