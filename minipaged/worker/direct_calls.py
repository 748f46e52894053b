"""Module calls straight to `forward`, for the CPU runner's small models.

`module(x)` runs `nn.Module.__call__`, two Python frames that look for hooks before they reach
`forward`. With stories260K a decode step makes about 60 module calls (5 layers of norms,
linear layers, RoPE + store, SiLU-and-multiply) around ops of a few microseconds each, so those
frames are a few percent of the step (benchmarks/README.md has the A/B).

`call_forward_directly(model)` gives each module below `model` a subclass of its own class, made
once per class, whose `__call__` *is* its `forward`. Registering a forward hook (or pre-hook) on
such a module first gives it its own class back, so the hook runs on every call as usual
(lesson 00's `when_hf.hook_captures` hooks a layer's MLP). Hooks registered for all modules at
once (`torch.nn.modules.module.register_module_forward_hook`) are not seen by them. Weights,
names, `isinstance` and `state_dict` are unchanged. `CPUModelRunner` applies it once, when the
engine is built.
"""
from __future__ import annotations

from torch import nn


def _direct_class(cls: type) -> type:
    """`cls` with `__call__ = forward`; hook registration restores `cls` first."""

    def register_forward_hook(self, *args, **kwargs):
        self.__class__ = cls  # the usual __call__, which runs hooks
        return self.register_forward_hook(*args, **kwargs)

    def register_forward_pre_hook(self, *args, **kwargs):
        self.__class__ = cls
        return self.register_forward_pre_hook(*args, **kwargs)

    return type(cls.__name__, (cls,), {
        "__call__": cls.forward, "register_forward_hook": register_forward_hook,
        "register_forward_pre_hook": register_forward_pre_hook,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def call_forward_directly(model: nn.Module) -> None:
    """Every module below `model` (not `model` itself, whose class others may check) without
    hooks calls its `forward` directly."""
    direct: dict[type, type] = {}
    for module in model.modules():
        cls = type(module)
        if module is model or "__call__" in vars(cls):
            continue  # the root, a class that calls its own way (or is converted already)
        if module._forward_hooks or module._forward_pre_hooks:
            continue  # hooked already: keep the calls that run them
        if cls not in direct:
            direct[cls] = _direct_class(cls)
        module.__class__ = direct[cls]
