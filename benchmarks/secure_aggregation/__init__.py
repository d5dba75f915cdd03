"""Secure aggregation cost benchmark (run.py)."""
