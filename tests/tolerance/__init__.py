"""Tests of tolerance/, on the hand-built traces of `tests.tolerance.synthetic`."""
