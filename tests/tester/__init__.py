"""Test-the-tester: deliberately wrong backends the verification suite must reject."""
