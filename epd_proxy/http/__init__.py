"""The client-facing server: the listening socket and its limits, routes, auth, the status page, worker processes."""
