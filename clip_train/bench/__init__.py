"""Benchmarks behind `clip-train bench …`; each runs its measurements in fresh subprocesses."""
