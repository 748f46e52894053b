"""`LoRARequest`: which adapter a request runs with (vLLM's class, name and field order).

    LoRARequest(lora_name, lora_int_id, lora_path)

`lora_int_id` is the adapter's identity inside the engine: requests with the same id share one
loaded copy of its weights, and the prefix cache keys its blocks by it (block_manager.py). It is
a `msgspec.Struct`, so it travels to the engine-core process inside `AddRequest` as plain
msgpack (server/messages.py), never pickled.
"""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    lora_name: str  # what the server lists in /v1/models and a request names in `model`
    lora_int_id: int  # >= 1; 0 would mean "no adapter" in the engine's per-token index
    lora_path: str  # a PEFT folder: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 means no adapter), got "
                             f"{self.lora_int_id!r} for adapter {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a folder path, got {self.lora_path!r} for "
                             f"adapter {self.lora_name!r}")
