"""Evaluation harnesses of fla-falcon (not part of the library API)."""
