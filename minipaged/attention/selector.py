"""Which attention backend a device gets when `EngineConfig.attention_backend` is unset (lesson 05).

`EngineConfig.resolve` asks `default_backend_name` once; `get_attention_backend`
(attention/__init__.py) then builds the chosen one. A leaf: it imports none of the backends, so
the config can ask it without importing the engine.
"""
from __future__ import annotations

BACKENDS = ("torch_ref", "cpu", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend_name(device: str) -> str:
    """`triton` on CUDA (`torch_ref` there without triton), `cpu` elsewhere (the CPU runs Triton
    only under TRITON_INTERPRET=1)."""
    if str(device).startswith("cuda"):
        return "triton" if triton_available() else "torch_ref"
    return "cpu"
