"""Continual OPCM: each task's update is projected away from the merged update, then rescaled."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from forgetless.contract.hooks import MethodState
from forgetless.contract.method import Capability, MethodConfig, declare_method
from forgetless.merging.blocks import is_block_matrix
from forgetless.merging.config import OPCMParams
from forgetless.merging.opcm import opcm_accumulate, opcm_lambda
from forgetless.methods.continual_merge import ContinualMerge, Tensors, kept_whole
from forgetless.methods.papers import cite


class OPCMConfig(MethodConfig, OPCMParams):
    name: Literal["opcm"] = "opcm"
    """Orthogonal projection continual merging."""


@declare_method(
    OPCMConfig, capabilities={Capability.TRAIN_STAGE, Capability.STATE}, paper=cite("tang2025")
)
class OPCM(ContinualMerge[OPCMConfig]):
    """OPCM (Tang et al. 2025, "Merging Models on the Fly Without Retraining: A Sequential
    Approach to Scalable Continual Model Merging", arXiv:2501.09522) run continually: task t
    trains from the merged state; per weight matrix its update is projected onto the orthogonal
    complement of the merged update's dominant singular subspace, R_t = R_{t−1} + P(Δ_t), and
    the merged update is τ̄_t = R_t / λ_t with λ_t = ‖R_t‖ / mean_{i≤t} ‖Δ_i‖ (whole-model norms).
    State: R (one copy of the trainable weights), the task norms and λ.
    """

    smoke: ClassVar[dict[str, Any]] = {"alpha": 0.5}
    unsharded = None  # the shared merge wiring hands it whole updates on a sharded model

    def __init__(self, config: OPCMConfig) -> None:
        super().__init__(config)
        self.accumulated: Tensors = {}
        self.task_norms: list[float] = []
        self.lam = 1.0

    def increment(self, deltas: Tensors, details: dict[str, Any]) -> Tensors:
        norm = sum(float(d.pow(2).sum()) for d in deltas.values()) ** 0.5
        new = {
            n: opcm_accumulate(
                self.accumulated[n].to(d.device) if n in self.accumulated else None,
                d,
                self.config.alpha,
                is_block_matrix(n, d),
            )
            for n, d in deltas.items()
        }
        norms = [*self.task_norms, norm]
        lam = opcm_lambda(sum(float(r.pow(2).sum()) for r in new.values()) ** 0.5, norms)
        out = {}
        for n, r in new.items():
            old = self.accumulated.get(n)
            out[n] = r / lam - (0 if old is None else old.to(r.device) / self.lam)
        self.accumulated = {n: r.detach().cpu() for n, r in new.items()}
        self.task_norms, self.lam = norms, lam
        details.update(opcm_lambda=lam, task_norm=norm)
        return out

    def state_dict(self) -> MethodState:
        return {
            "accumulated": dict(self.accumulated),
            "task_norms": list(self.task_norms),
            "lambda": self.lam,
        }

    def load_state_dict(self, state: MethodState) -> None:
        self.accumulated = kept_whole(state.get("accumulated", {}))
        self.task_norms = [float(v) for v in state.get("task_norms", [])]
        self.lam = float(state.get("lambda", 1.0))
