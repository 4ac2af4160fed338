"""The engine: the step loop, its progress, tracking and step checkpoints."""
