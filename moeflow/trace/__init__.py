"""Routing traces: their file format, recording them from a model, and synthetic traces for tests and the simulator."""
