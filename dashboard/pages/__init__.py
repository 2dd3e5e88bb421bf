"""The dashboard's views, one module each (Dash Pages)."""
