"""What a TandemModule checkpoint holds: the trainable tensors only (the junior, the reference
copy and frozen base weights are rebuilt from their sources on load), the metric history and the
run id; and the one-line summary of what trains."""

from __future__ import annotations

from typing import Any

from torch import nn


def trainable_keys(senior: nn.Module) -> set[str]:
    return {f"senior.{n}" for n, p in senior.named_parameters() if p.requires_grad}


def keep_trainable(senior: nn.Module, checkpoint: dict[str, Any], history: list, run_id: str | None) -> None:
    """Drop every tensor training does not change from ``checkpoint`` (in place)."""
    trainable = trainable_keys(senior)
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
    checkpoint["tandem_lit"] = {"trainable_keys": sorted(trainable), "history": history, "run_id": run_id}


def check_trainable(senior: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint whose trainable tensors are not this senior's (another model, other LoRA settings)."""
    saved = set(checkpoint.get("tandem_lit", {}).get("trainable_keys", []))
    expected = trainable_keys(senior)
    # (FSDP2Strategy has loaded the weights into the shards already and passes no state_dict)
    missing = expected - set(checkpoint["state_dict"] if "state_dict" in checkpoint else saved)
    if missing or (saved and saved != expected):
        raise RuntimeError(
            f"checkpoint does not match this model: {len(missing)} trainable tensors missing "
            f"(e.g. {sorted(missing)[:3]}); load it with the same senior and lora settings it was trained with"
        )


def models_line(senior: nn.Module, junior: nn.Module | None, lora) -> str:
    """One line on what trains and what does not (in place of Lightning's model summary)."""
    def count(model: nn.Module, trainable: bool | None = None) -> str:
        n = sum(p.numel() for p in model.parameters() if trainable is None or p.requires_grad == trainable)
        return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.1f} K"

    dtype = str(next(senior.parameters()).dtype).removeprefix("torch.")
    line = f"senior {count(senior)} parameters ({count(senior, True)} trained, {dtype}"
    line += f", LoRA r={lora.r})" if lora else ")"
    if junior is not None:
        line += f"; junior {count(junior)} (frozen)"
    return line
