"""The package version (one place; the manifest and ``tokentrace --version`` read it)."""

__version__ = "0.1.0"
