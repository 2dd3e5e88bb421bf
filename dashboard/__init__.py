"""The Dash dashboard that renders analyzer results."""
