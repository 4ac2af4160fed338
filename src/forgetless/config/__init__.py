"""Configuration schema and loading."""
