"""Pure functions from store tables to result tables."""
