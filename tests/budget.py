"""How many examples each property test draws: one budget for the suite, read once.

Every property test asks ``examples(n)``: ``n`` is its share of the budget, 100 for most
(hypothesis's own default), fewer where one example costs a live request.
``TESTS_EXAMPLES_SCALE`` multiplies them all: 1 in ``make test`` (CI), which draws new
examples on every run (the tests are not derandomized); ``TESTS_EXAMPLES_SCALE=10 make
test`` for a deeper search before a release or after changing the algorithm.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("TESTS_EXAMPLES_SCALE", "1"))


def examples(n: int = 100) -> int:
    return max(1, round(n * SCALE))
