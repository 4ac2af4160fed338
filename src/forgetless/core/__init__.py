"""The ground floor: atomic files and safetensors, process-group plumbing, low-rank updates, the
cache and the method registry. Nothing here imports another forgetless package but ``errors``
and ``strict``."""
