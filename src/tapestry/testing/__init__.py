"""Hypothesis strategies and checkers shared by the tests and `tapestry check-rules`."""
