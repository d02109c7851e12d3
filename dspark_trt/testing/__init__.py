"""Helpers for tests and quick experiments: tiny real checkpoints built locally (no downloads, `tiny`) and
round-to-nearest quantized copies of a runtime model (`quantize`)."""
