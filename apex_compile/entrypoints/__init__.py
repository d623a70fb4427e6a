"""Entry points that serve the engine."""
