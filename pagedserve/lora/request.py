"""A request's LoRA adapter, named as in vLLM: `LoRARequest(name, int_id, path)`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request uses.

    Args:
        lora_name: a human-readable name (error messages, metrics, the API's `model`).
        lora_int_id: the engine's key for the adapter, >= 1 (0 means "base model" in
            `Request.lora_id` and the prefix-cache key).
        lora_path: folder with adapter_config.json + adapter_model.safetensors (or .bin).
        base_model_name: the base model the adapter was trained on (informational, as in vLLM).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"lora_path: adapter {self.lora_name!r} needs the folder of its PEFT files")


class AdapterNotRegisteredError(LookupError):
    """A request names an adapter that is not (or no longer) registered: it was unloaded.

    The serving path never registers an adapter implicitly (that would bring an unloaded
    adapter back as a phantom nothing lists or can unload); the server answers 404 naming it.
    """

    def __init__(self, lora_name: str) -> None:
        super().__init__(f"The model `{lora_name}` does not exist (the LoRA adapter was unloaded).")
        self.lora_name = lora_name
