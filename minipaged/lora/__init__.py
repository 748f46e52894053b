"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch (lesson 11).

    request.py        LoRARequest(lora_name, lora_int_id, lora_path): vLLM's request field
    adapter.py        read a PEFT folder, check it against the model (rank, modules, shapes)
    punica.py         the per-token gathered shrink/expand in torch (the oracle), and the
                      step's token -> slot mapping (PunicaWrapper)
    triton_punica.py  the same shrink/expand as Triton kernels, tokens taken in slot order
    layers.py         LoRALinear: a base linear layer plus `max_loras` weight slots
    manager.py        wraps the model's layers once; adapters into slots on demand, LRU,
                      and at most max_cpu_loras of them kept in CPU memory
    runner.py         the model runner that maps the step's tokens to slots before the forward
    scheduling.py     the scheduler's admission rule (max_loras) and the prefix cache's key
    random_adapter.py random adapters in PEFT's format, without peft (benchmarks, GPU tests)

The engine builds it only with `EngineConfig.enable_lora`; the scheduler keeps at most
`max_loras` distinct adapters in a step, and the prefix cache keys blocks by adapter (both
attached by engine/build.py).
"""
from minipaged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
