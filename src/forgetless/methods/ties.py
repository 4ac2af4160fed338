"""Continual TIES-merging: the merged update is TIES over every task's update so far."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch

from forgetless.contract.hooks import MethodState
from forgetless.contract.method import Capability, MethodConfig, declare_method
from forgetless.merging.config import TiesParams
from forgetless.merging.ties import ties_merge
from forgetless.methods.continual_merge import ContinualMerge, Tensors, kept_whole
from forgetless.methods.papers import cite


class TiesConfig(MethodConfig, TiesParams):
    name: Literal["ties"] = "ties"
    """Continual TIES-merging."""


@declare_method(
    TiesConfig, capabilities={Capability.TRAIN_STAGE, Capability.STATE}, paper=cite("yadav2023")
)
class Ties(ContinualMerge[TiesConfig]):
    """TIES-merging (Yadav et al. 2023, "TIES-Merging: Resolving Interference When Merging
    Models", NeurIPS) run continually: after task t the model is θ_0 + λ·TIES(Δ_1, …, Δ_t), each
    Δ_i the update of task i from the merged state it started at. Applied as the change
    λ·(TIES(Δ_{≤t}) − TIES(Δ_{<t})) so θ_0 is never needed. Memory: every task's update of the
    trainable weights is kept (on the CPU, and in the checkpoint's method state).
    """

    smoke: ClassVar[dict[str, Any]] = {"density": 0.5}
    unsharded = None  # the shared merge wiring hands it whole updates on a sharded model

    def __init__(self, config: TiesConfig) -> None:
        super().__init__(config)
        self.updates: list[Tensors] = []

    def _merged(self, name: str, upto: int, device: torch.device) -> torch.Tensor | None:
        vectors = [u[name].to(device) for u in self.updates[:upto]]
        if not vectors:
            return None
        cfg = self.config
        return ties_merge(vectors, cfg.density, None, cfg.convention, cfg.normalize)

    def increment(self, deltas: Tensors, details: dict[str, Any]) -> Tensors:
        previous = len(self.updates)
        self.updates.append({n: d.detach().cpu() for n, d in deltas.items()})
        out = {}
        for name, delta in deltas.items():
            now = self._merged(name, previous + 1, delta.device)
            before = self._merged(name, previous, delta.device)
            assert now is not None
            change = now if before is None else now - before
            out[name] = self.config.scaling * change
        return out

    def state_dict(self) -> MethodState:
        return {"updates": {str(i): dict(u) for i, u in enumerate(self.updates)}}

    def load_state_dict(self, state: MethodState) -> None:
        stored = state.get("updates", {})
        self.updates = [kept_whole(stored[k]) for k in sorted(stored, key=int)]
