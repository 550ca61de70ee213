"""Helpers the test modules share (instead of importing from each other)."""
