"""A memory model: bytes per device for each method and regime under DDP, FSDP and ZeRO-3.

The accounting of the ZeRO paper (Rajbhandari et al. 2020) for mixed-precision AdamW: weights
and gradients in bf16 (2 + 2 bytes per trainable parameter) and fp32 master weights and two
moments (12 bytes), so 16 bytes per trainable parameter; a frozen weight costs its 2 bytes.
Each method adds what it keeps per parameter (below). Activations, the data and the caches that
scale with tokens (SAE-FD's anchors, Anchored Learning's top-k cache, replay's buffer) are left
out: they do not scale with the model's size. DDP replicates everything; FSDP (full shard) and
ZeRO-3 divide weights, gradients, optimizer state and element-wise method state by the number of
devices; ZeRO-2 divides only gradients and optimizer state.

    python studies/memory_model.py            # prints the table the docs quote

``render_tables.py`` renders it into docs/scale-out.md between ``memory-table`` markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRAINABLE_BYTES = 16.0
"""bf16 weight + bf16 gradient + fp32 master weight + two fp32 AdamW moments."""
FROZEN_BYTES = 2.0
LORA_FRACTION = 0.005
"""Trainable share of a LoRA r 8 on every linear layer of a 7B Llama (about 20M of 6.7B; the
share is close to this across the sizes below)."""
MODEL_SIZES = {"0.5B": 0.5e9, "7B": 7e9, "70B": 70e9}
STRATEGIES = ("DDP", "ZeRO-2", "FSDP / ZeRO-3")


@dataclass(frozen=True)
class MethodMemory:
    """What a method keeps besides the trained model: parameter-sized tensors, by their width."""

    trainable_widths: tuple[float, ...] = ()
    """Bytes per element of each element-wise copy of the trainable weights (sharded with them
    under FSDP / ZeRO-3)."""
    weight_widths: tuple[float, ...] = ()
    """Bytes per element of each copy of the whole model (a frozen reference: sharded too when
    wrapped alike)."""
    why: str = ""
    full_only_copies: bool = False
    """The whole-model copies are kept only without LoRA: under LoRA the model with its
    adapters switched off serves (KL-SFT's and ASFT's reference)."""
    copies_hold_adapters: bool = False
    """Each whole-model copy is a copy of the adapted model: under LoRA it holds the adapters
    too (one trainable-sized tensor more per copy)."""
    whole_widths: tuple[float, ...] = ()
    """Bytes per element of each copy of the trainable weights kept whole on every device even
    under FSDP (state a method normalises per whole tensor, such as the attribution maps)."""

    @property
    def per_whole(self) -> float:
        return sum(self.whole_widths)

    @property
    def per_trainable(self) -> float:
        return sum(self.trainable_widths)

    @property
    def per_weight(self) -> float:
        return sum(self.weight_widths)


METHODS = {
    "seq_ft": MethodMemory(why="the model and AdamW"),
    "replay": MethodMemory(why="a buffer of examples (token-sized)"),
    "ewc": MethodMemory((4.0, 2.0), why="fp32 Fisher + bf16 anchor weights"),
    "kl_sft": MethodMemory(
        (),
        (2.0,),
        "a frozen bf16 reference model (none under LoRA: the adapter-free model)",
        full_only_copies=True,
    ),
    "low_lr": MethodMemory(why="the model and AdamW"),
    "anchored": MethodMemory(
        (),
        (2.0, 2.0),
        "frozen bf16 copies of the SFT reference and of θ(t) (`measure`), adapters included",
        copies_hold_adapters=True,
    ),
    "attribution_gate": MethodMemory(
        (2.0, 2.0),
        why="fp16 importance map (whole on every device under FSDP), its gate factors, a bf16 "
        "pre-step snapshot",
        whole_widths=(2.0,),
    ),
    "sae_fd": MethodMemory(why="an SAE of one layer and anchors (fixed, not per parameter)"),
    "task_arithmetic": MethodMemory((2.0, 2.0), why="bf16 task start and merged state"),
    "o_lora": MethodMemory((2.0,), why="each past adapter (LoRA-sized; one per past task)"),
}

TOLERANCE = 0.1
"""Parameter-sized tensors: a measured count within this of the model's is a match (token-sized
state, such as replay's buffer or SAE-FD's anchors, stays far below one copy)."""


def predicted_copies(name: str, row: dict[str, Any]) -> float:
    """The model's extra elements for ``name`` in ``row``'s setting (its ``trainable`` and
    base ``weights`` counts, its ``mode``), in trainable-weight-sized tensors."""
    memory = METHODS[name]
    copy = row["weights"]
    if memory.copies_hold_adapters and row.get("mode") == "lora":
        copy += row["trainable"]
    widths = len(memory.trainable_widths) + len(memory.whole_widths)
    copies = (
        0 if memory.full_only_copies and row.get("mode") == "lora" else len(memory.weight_widths)
    )
    extra = widths * row["trainable"] + copies * copy
    return extra / row["trainable"]


def per_device_gb(
    params: float, method: MethodMemory, lora: bool, strategy: str, devices: int
) -> float:
    """GB on each device for a model of ``params`` parameters."""
    trainable = params * (LORA_FRACTION if lora else 1.0)
    frozen = params - trainable if lora else 0.0
    copy = params + (trainable if lora and method.copies_hold_adapters else 0.0)
    per_weight = 0.0 if lora and method.full_only_copies else method.per_weight
    weights = trainable * 2.0 + frozen * FROZEN_BYTES + copy * per_weight
    grads_and_optimizer = trainable * (TRAINABLE_BYTES - 2.0)
    state = trainable * method.per_trainable
    whole = trainable * method.per_whole  # never divided
    if strategy == "ZeRO-2":
        grads_and_optimizer /= devices
    elif strategy != "DDP":
        weights, grads_and_optimizer, state = (
            weights / devices,
            grads_and_optimizer / devices,
            state / devices,
        )
    return (weights + grads_and_optimizer + state + whole) / 1e9


def table(devices: int = 8) -> str:
    """Markdown: one row per method and regime, one column per model size and strategy."""
    heads = [f"{size} {s}" for size in MODEL_SIZES for s in STRATEGIES]
    lines = [
        "| method | regime | " + " | ".join(heads) + " | kept per parameter |",
        "|---|---|" + "---|" * (len(heads) + 1),
    ]
    for name, method in METHODS.items():
        for lora in (False, True):
            cells = [
                f"{per_device_gb(p, method, lora, s, devices):.1f}"
                for p in MODEL_SIZES.values()
                for s in STRATEGIES
            ]
            regime = "LoRA" if lora else "full"
            lines.append(f"| `{name}` | {regime} | " + " | ".join(cells) + f" | {method.why} |")
    return "\n".join(lines) + "\n"


def check_table(report: dict[str, Any]) -> str:
    """Markdown: ``memory_check.py``'s measured parameter-sized tensors beside what the model
    predicts now (recomputed from ``METHODS``, so a corrected entry shows at once)."""
    lines = [
        "| method | regime | model: extra tensors | measured | extra bytes per trainable weight"
        " (float32 run) | match |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        regime = "LoRA" if row["mode"] == "lora" else "full"
        predicted = predicted_copies(row["method"], row)
        match = abs(row["measured_copies"] - predicted) <= TOLERANCE
        lines.append(
            f"| `{row['method']}` | {regime} | {predicted:.2f} "
            f"| {row['measured_copies']:.2f} | {row['extra_bytes_per_trainable']:.1f} "
            f"| {'yes' if match else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table())
