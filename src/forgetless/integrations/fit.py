"""Which methods fit inside a ``transformers.Trainer`` step, and the one line for those that do
not.

A method fits when every hook it declares runs at a point a trainer offers: loss terms and
batch transforms in ``compute_loss``, gradient hooks and update gates around the optimizer step,
task-boundary work between two ``train()`` calls. A method that trains the task itself
(``TRAIN_STAGE``: an outer loop, a merge after its own run, generation between runs), hands a
transformed model to evaluation, or needs forgetless's per-task LoRA adapters cannot be put
inside someone else's step; it runs with ``forgetless.ContinualTrainer`` instead.
"""

from __future__ import annotations

from forgetless.contract.method import Capability, Method, registered_methods

STAGE_WHY: dict[str, str] = {
    "anchored": "Anchored Learning's outer loop moves its anchor between many inner SFT runs of "
    "each task",
    "low_lr": "it trains each task in its own stage at a scaled learning rate (in a Trainer, "
    "lower args.learning_rate instead)",
    "mtl": "it trains once on every task of the sequence together, which a trainer given one "
    "task's data never holds",
    "opcm": "it merges each task's fine-tuned weights into the model by orthogonal projection "
    "after its own training stage",
    "rl": "it runs an SFT stage then an RL stage with sampled generations for each task",
    "sdft": "it samples completions every step and builds its teacher's prompt from each "
    "example's demonstration text, which a trainer's token batches do not carry",
    "self_sft": "it generates its own targets with the current model between runs of the step loop",
    "task_arithmetic": "it adds each task's fine-tuned weights to the model as a task vector "
    "after its own training stage",
    "ties": "it merges each task's fine-tuned weights by TIES after its own training stage",
}
"""Why each built-in stage method cannot run inside a trainer's step."""


def _why(cls: type[Method]) -> str | None:
    caps = cls.capabilities
    if Capability.TRAIN_STAGE in caps:
        return STAGE_WHY.get(
            cls.name,
            "it trains each task in its own stage (an outer loop, a merge or generation between "
            "runs of the step loop)",
        )
    if Capability.MODEL_TRANSFORM in caps:
        return "it evaluates a transformed model, not the one the trainer trains"
    regimes = cls.lora_regimes
    if regimes is not None and "carry" not in regimes:
        return (
            f"it trains a new LoRA adapter per task beside the frozen past ones (regime "
            f"{' or '.join(regimes)}), which forgetless's finetuner adds at each task boundary"
        )
    return None


def refusal(cls: type[Method]) -> str | None:
    """The one line that says why ``cls`` cannot run inside a trainer, or None when it can."""
    why = _why(cls)
    if why is None:
        return None
    return (
        f"method {cls.name!r} does not fit a trainer step: {why}; "
        f"run it with forgetless.ContinualTrainer(..., method={cls.name!r})"
    )


def trainer_support() -> dict[str, str | None]:
    """Every registered method and its refusal (None: it runs inside a trainer), by name."""
    return {name: refusal(cls) for name, cls in sorted(registered_methods().items())}
