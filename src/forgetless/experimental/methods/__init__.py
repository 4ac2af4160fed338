"""Methods still in the experimental corner, found by the registry like the built-ins (their
import warns once, when a config first names one, never in the middle of a task)."""
