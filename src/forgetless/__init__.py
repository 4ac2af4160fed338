"""forgetless: continual post-training of language models, forgetting measured and explained."""

__version__ = "0.1.0"
