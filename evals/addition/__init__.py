"""Variable-length addition: train on short operands, test exact match on longer ones (paper section on
length extrapolation, SPEC section 6). Run ``python -m evals.addition --help``."""

from evals.addition.data import AdditionTokenizer, make_batch, exact_match  # noqa: F401
