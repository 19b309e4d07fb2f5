"""Hypothesis strategies and checkers shared by the tests and `tapestry check-rules`, and a training step checked
against torch's (versus_torch)."""
