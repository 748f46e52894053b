"""Module calls straight to `forward`, for the CPU runner's small models.

`module(x)` runs `nn.Module.__call__`, two Python frames that look for hooks before they reach
`forward`, and `self.qkv_proj` or `self.weight` inside `forward` is `nn.Module.__getattr__`, a
Python function that searches the module's parameter, buffer and submodule dicts. With
stories260K a decode step makes about 60 module calls and 120 such lookups around ops of a few
microseconds each, so they are a few percent of the step (benchmarks/README.md has the A/B).

`call_forward_directly(model)` gives each module below `model` a subclass of its own class, made
once per class, whose `__call__` *is* its `forward`, and copies the module's parameters, buffers
and submodules into its instance `__dict__`, where attribute lookup finds them without
`__getattr__`. The subclass keeps those copies true: assigning or deleting one (`__setattr__`,
`__delattr__`) and `.to()` / `.float()` (`_apply`) update them. Registering a forward hook (or
pre-hook) on such a module gives it its own class back (and drops the copies), so the hook runs
on every call as usual (lesson 00's `when_hf.hook_captures` hooks a layer's MLP). Hooks
registered for all modules at once (`torch.nn.modules.module.register_module_forward_hook`) are
not seen by them. Weights, names, `isinstance` and `state_dict` are unchanged.
`CPUModelRunner` applies it once, when the engine is built.
"""
from __future__ import annotations

from torch import nn

_MEMBERS = ("_parameters", "_buffers", "_modules")


def _copy_members(module: nn.Module) -> None:
    d = module.__dict__
    for store in _MEMBERS:
        d.update(d[store])


def _drop_members(module: nn.Module) -> None:
    d = module.__dict__
    for store in _MEMBERS:
        for name in d[store]:
            d.pop(name, None)


def _direct_class(cls: type) -> type:
    """`cls` with `__call__ = forward` and its members' copies kept true."""

    def __setattr__(self, name, value):
        cls.__setattr__(self, name, value)
        d = self.__dict__
        for store in _MEMBERS:
            if name in d[store]:
                d[name] = d[store][name]

    def __delattr__(self, name):
        d = self.__dict__
        if any(name in d[store] for store in _MEMBERS):
            d.pop(name, None)
        cls.__delattr__(self, name)

    def _apply(self, *args, **kwargs):
        out = cls._apply(self, *args, **kwargs)  # may put new tensors in _parameters / _buffers
        _copy_members(self)
        return out

    def _restore(self):
        _drop_members(self)
        self.__class__ = cls  # the usual __call__ (which runs hooks) and attribute lookup

    def register_forward_hook(self, *args, **kwargs):
        _restore(self)
        return self.register_forward_hook(*args, **kwargs)

    def register_forward_pre_hook(self, *args, **kwargs):
        _restore(self)
        return self.register_forward_pre_hook(*args, **kwargs)

    return type(cls.__name__, (cls,), {
        "__call__": cls.forward, "__setattr__": __setattr__, "__delattr__": __delattr__,
        "_apply": _apply, "register_forward_hook": register_forward_hook,
        "register_forward_pre_hook": register_forward_pre_hook,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def call_forward_directly(model: nn.Module) -> None:
    """Every module below `model` (not `model` itself, whose class others may check) without
    hooks calls its `forward` directly and finds its members in its `__dict__`."""
    direct: dict[type, type] = {}
    for module in model.modules():
        cls = type(module)
        if module is model or "__call__" in vars(cls):
            continue  # the root, or a class that calls its own way (or is converted already)
        if module._forward_hooks or module._forward_pre_hooks:
            continue  # hooked already: keep the calls that run them
        if cls not in direct:
            direct[cls] = _direct_class(cls)
        module.__class__ = direct[cls]
        _copy_members(module)
