"""Side-by-side benchmarks of methods over seeds and task orders."""
