"""Tapestry."""
