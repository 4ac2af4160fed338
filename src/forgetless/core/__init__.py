"""The ground floor: atomic files and safetensors, process-group plumbing, low-rank updates, the
cache, the method registry and small helpers on torch modules. Nothing here imports another
forgetless package but ``errors`` and ``strict``."""
