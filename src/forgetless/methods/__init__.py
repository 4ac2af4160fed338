"""Forgetting-control methods, one module each, imported on first use through the registry
(``forgetless.core.registry``). The interface they implement is ``forgetless.contract``."""
