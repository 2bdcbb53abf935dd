"""Fixtures of the plugin tests."""

from ._te_wheels import te_source  # noqa: F401  (the fixture that serves TE's wheels as test data)
