"""Peers our benchmarks measure against, built from registry packages."""
