"""What a TandemModule checkpoint holds: the trainable tensors only (the junior, the reference
copy and frozen base weights are rebuilt from their sources on load), the metric history and the
run id; and the one-line summary of what trains."""

from __future__ import annotations

from typing import Any

from torch import nn

from tandem_lit.errors import ConfigError


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
    state = checkpoint.get("state_dict", {})
    missing = expected - set(state if "state_dict" in checkpoint else saved)
    fix = "load it with the same senior and lora settings it was trained with"
    if missing or (saved and saved != expected):
        raise ConfigError(
            f"checkpoint does not match this model: {len(missing)} trainable tensors missing "
            f"(e.g. {sorted(missing)[:3]}); {fix}"
        )
    raise_on_other_shapes({f"senior.{n}": p for n, p in senior.named_parameters()}, state, fix)


def raise_on_other_shapes(parameters: dict[str, nn.Parameter], state: dict[str, Any], fix: str) -> None:
    """A checkpoint of another model under the same tensor names (a wider or deeper config)
    fails here with the first tensor whose shape differs, not in torch's load_state_dict."""
    for name, tensor in state.items():
        parameter = parameters.get(name)
        if parameter is not None and hasattr(tensor, "shape") and tuple(tensor.shape) != tuple(parameter.shape):
            raise ConfigError(
                f"checkpoint does not match this model: {name} is {list(tensor.shape)} in the checkpoint and "
                f"{list(parameter.shape)} here; {fix}"
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
