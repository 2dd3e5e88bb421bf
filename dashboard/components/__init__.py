"""Shared widgets of the dashboard: frame, controls, figures, waterfall, explanations."""
