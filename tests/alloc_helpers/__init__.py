"""Helpers for the allocator and launcher tests (not a test module)."""
