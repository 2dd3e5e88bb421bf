"""Adapters that turn what a server does into tokentrace events."""
