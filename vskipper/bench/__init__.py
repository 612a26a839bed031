"""Benchmarks that ship with the package (`vskipper bench ...`); bench/*.py are thin wrappers."""
