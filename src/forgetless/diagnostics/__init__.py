"""Diagnostics of a finished run: update geometry and its conflict with the evolving state."""
