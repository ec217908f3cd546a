"""A test that skips: run by test_faults to check that a skip fails the suite. Not collected itself."""

import pytest


def test_that_skips():
    pytest.skip("a check that did not run")
