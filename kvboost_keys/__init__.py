"""Chunk keys computed once, in one place: the service and the router key a prompt the same way (pure, no torch)."""
