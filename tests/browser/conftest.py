"""The browser tests drive the same in-process fake stack as the HTTP tests."""

from tests.http.conftest import make_stack  # noqa: F401  (re-exported fixture)
