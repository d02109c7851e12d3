"""Helpers for tests and quick experiments: tiny real checkpoints built locally (no downloads)."""
