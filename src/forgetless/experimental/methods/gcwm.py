"""Continual GCWM (experimental): merge each task's update under the shared Wasserstein metric.

It lives in the experimental corner until its tests and bench rows stand; forgetless's own
``pyproject.toml`` declares it in the entry-point group ``forgetless.methods``, so the registry
imports it (and it warns, once) when a config first names it."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from forgetless.contract.hooks import MethodState
from forgetless.contract.method import Capability, MethodConfig, Paper, declare_method
from forgetless.core.fields import NonNegative
from forgetless.diagnostics.geometry import LowRank
from forgetless.experimental.gcwm import GCWMParams, gcwm_layer, truncate
from forgetless.merging.blocks import is_block_matrix
from forgetless.methods.continual_merge import ContinualMerge, Tensors


class GCWMConfig(MethodConfig, GCWMParams):
    name: Literal["gcwm"] = "gcwm"
    """Geometry-conflict Wasserstein merging."""
    scaling: NonNegative = 1.0
    """w, each task's weight in the plain branch Σ_t w Δ_t and in the consensus (1: the plain branch
    is sequential fine-tuning). Toolkit default."""


@declare_method(
    GCWMConfig,
    capabilities={Capability.TRAIN_STAGE, Capability.STATE},
    paper=Paper(
        "Geometry Conflict: Explaining and Controlling Forgetting in LLM Continual Post-Training"
    ),
)
class GCWM(ContinualMerge[GCWMConfig]):
    """GCWM, from "Geometry Conflict: Explaining and Controlling Forgetting in LLM Continual
    Post-Training" (experimental: ``forgetless.experimental.gcwm``, docs/merging.md). Task t
    trains from the merged state; per weight matrix the updates Δ_1..Δ_t of the active tasks
    (kept as rank-``rank`` factors) give a shared metric (their Gaussian Wasserstein barycenter),
    a conflict κ and a gated geometry-aware correction C_t. The merged update is
    Σ_i w Δ_i + C_t, applied incrementally: θ_t = θ_{t−1} + w Δ_t + C_t − C_{t−1}. Other
    weights (norms, embeddings) take the plain branch. State: the factors and C_{t−1}.
    """

    smoke: ClassVar[dict[str, Any]] = {"rank": 4}

    def __init__(self, config: GCWMConfig) -> None:
        super().__init__(config)
        self.updates: list[dict[str, dict[str, Any]]] = []
        self.correction: dict[str, dict[str, Any]] = {}

    def increment(self, deltas: Tensors, details: dict[str, Any]) -> Tensors:
        opts = self.config
        own: dict[str, dict[str, Any]] = {}
        out, conflicts, gates, per_layer = {}, [], [], {}
        for name, delta in deltas.items():
            out[name] = self.config.scaling * delta
            if not is_block_matrix(name, delta):
                continue
            factors = truncate(delta.cpu(), self.config.rank)[0]
            own[name] = {"left": factors.left, "right": factors.right}
            history = [LowRank(u[name]["left"], u[name]["right"]) for u in self.updates]
            layer = gcwm_layer(
                [*history, factors], [self.config.scaling] * (len(history) + 1), opts
            )
            change = layer.correction.dense()
            if name in self.correction:
                old = self.correction[name]
                change = change - old["left"].to(change) @ old["right"].to(change)
            out[name] = out[name] + change.to(delta)
            self.correction[name] = {
                "left": layer.correction.left.cpu(),
                "right": layer.correction.right.cpu(),
            }
            conflicts.append(layer.conflict)
            gates.append(layer.gate)
            per_layer[name] = {"conflict": layer.conflict, "gate": layer.gate}
        self.updates.append(own)
        if conflicts:
            details.update(
                gcwm_conflict_mean=sum(conflicts) / len(conflicts),
                gcwm_gate_mean=sum(gates) / len(gates),
                gcwm_layers=len(conflicts),
                gcwm_per_layer=per_layer,
            )
        return out

    def state_dict(self) -> MethodState:
        return {
            "updates": {str(i): u for i, u in enumerate(self.updates)},
            "correction": dict(self.correction),
        }

    def load_state_dict(self, state: MethodState) -> None:
        stored = state.get("updates", {})
        self.updates = [dict(stored[k]) for k in sorted(stored, key=int)]
        self.correction = dict(state.get("correction", {}))
