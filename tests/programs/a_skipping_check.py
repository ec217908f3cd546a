"""A test that skips: run by test_faults to check that a skip fails the suite.

Not collected by the suite itself: its name matches neither test_*.py nor *_test.py.
"""

import pytest


def test_that_skips():
    pytest.skip("a check that did not run")
