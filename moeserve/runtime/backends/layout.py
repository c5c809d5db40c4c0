"""Inference forms of the model's modules: the same parameters and children, another forward.

A backend lays a model out once, when it is loaded, by putting one of these in place of a plain module (an
nn.Linear run on the C kernel, an `Experts` run by token count on fused weights, ...). Which way a module runs
is then which class it is, not a flag read at every call. Each form is made from the plain module by `Laid.of`,
which shares its parameter and child dicts (state_dict, and anything reading `.weight`, are unchanged) and adds
what the form needs (a packed copy, a C kernel's handle); `plain_` puts the plain modules back, which a backend
does before laying a model out again (after its weights, dtype or device changed).
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

M = TypeVar("M", bound="Laid")


class Laid(nn.Module):
    """A module's inference form (mixed in before the plain class it stands for)."""

    @classmethod
    def of(cls: type[M], module: nn.Module, **extra) -> M:
        """`module` as this form: its own dicts (parameters, buffers, children, attributes) and `extra`'s values,
        which `plain` drops again. `extra` values are attributes, never registered: a packed copy of a weight is
        not a parameter of the model."""
        laid = cls.__new__(cls)
        laid.__dict__.update(module.__dict__)
        laid.__dict__.update(extra)
        laid.__dict__["_laid"] = (type(module), tuple(extra))
        return laid

    def plain(self) -> nn.Module:
        kind, extra = self.__dict__["_laid"]
        module = kind.__new__(kind)
        module.__dict__.update({k: v for k, v in self.__dict__.items() if k not in extra and k != "_laid"})
        return module


def plain_(module: nn.Module) -> int:
    """Put back the plain module for every inference form under `module` (not `module` itself); how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, Laid):
            child = child.plain()
            setattr(module, name, child)
            n += 1
        n += plain_(child)
    return n


def lay_out_(module: nn.Module, form) -> int:
    """Replace every module under `module` for which form(child) returns a module by what it returns (children of
    a replaced module are visited too); how many were replaced."""
    n = 0
    for name, child in list(module.named_children()):
        laid = form(child)
        if laid is not None:
            setattr(module, name, laid)
            child, n = laid, n + 1
        n += lay_out_(child, form)
    return n
