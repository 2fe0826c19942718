"""Fixtures of the HTTP tests beyond the shared stacks (tests/conftest.py)."""

from tests.http.raw_backends import peer, upstream  # noqa: F401 (fixtures of the upstream tests)
