"""Benchmarks behind `clip-train bench …`: command modules outside the library (nothing in it imports
them). Each measurement runs in a fresh process (``runner``), so its memory peak is its own."""
