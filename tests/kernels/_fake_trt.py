"""A minimal stand-in for `tensorrt` + `tensorrt.plugin` (QDP) so registration code runs without TensorRT.

Records every @register / @aot_impl function and checks them the way tensorrt.plugin does when it parses them
(read from NVIDIA/TensorRT python/packaging/bindings_wheel/tensorrt/plugin/_validate.py): annotations are real
classes, TensorDesc args first then builtin-typed attributes, the register return is TensorDesc or a Tuple of
exactly N TensorDescs (N = outputs), aot_impl's parameters are (tensors, attrs, outputs, tactic) and it returns
Tuple[str|bytes, str|bytes, KernelLaunchParams, SymIntExprs]. Shape expressions are ints with `is_constant`.
"""
from __future__ import annotations

import inspect
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable


class Dim(int):
    """A constant shape expression."""

    @property
    def is_constant(self) -> bool:
        return True

    @property
    def constant_value(self) -> int:
        return int(self)

    def __mul__(self, other: Any) -> "Dim":
        return Dim(int(self) * int(other))

    __rmul__ = __mul__

    def __sub__(self, other: Any) -> "Dim":
        return Dim(int(self) - int(other))


@dataclass
class TensorDesc:
    shape: tuple[int, ...]
    dtype: str

    @property
    def shape_expr(self) -> tuple[Dim, ...]:
        return tuple(Dim(d) for d in self.shape)


@dataclass
class KernelLaunchParams:
    grid_x: Any = 1
    grid_y: Any = 1
    grid_z: Any = 1
    block_x: Any = 1
    block_y: Any = 1
    block_z: Any = 1
    shared_mem: Any = 0


@dataclass
class SymInt32:
    value: Any


class SymExprs:
    pass


@dataclass
class SymIntExprs(SymExprs):
    items: list = field(default_factory=list)

    @classmethod
    def from_tuple(cls, items: Any) -> "SymIntExprs":
        return cls(list(items))


REGISTERED: dict[str, Callable[..., Any]] = {}
AOT: dict[str, Callable[..., Any]] = {}
SCHEMA: dict[str, tuple[list[str], list[str], int]] = {}  # plugin id → (tensor names, attr names, outputs)
BUILTIN_ATTRS = (int, float, bytes, bool, str)


def _desc_tuple(ann: Any, what: str) -> int:
    """Arity of a Tuple[TensorDesc, ...N] annotation (no Ellipsis), or 1 for a bare TensorDesc."""
    if isinstance(ann, type) and issubclass(ann, TensorDesc):
        return 1
    assert typing.get_origin(ann) is tuple, f"{what}: expected Tuple[TensorDesc, ...], got {ann!r}"
    args = typing.get_args(ann)
    assert args and all(isinstance(a, type) and issubclass(a, TensorDesc) for a in args), f"{what}: {ann!r}"
    return len(args)


def register(plugin_id: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    ns, name = plugin_id.split("::")
    assert ns not in ("", "trt", "tensorrt", "std") and "." not in ns + name, plugin_id

    def inner(fn: Callable[..., Any]) -> Callable[..., Any]:
        assert plugin_id not in REGISTERED, f"{plugin_id} registered twice"
        tensors: list[str] = []
        attrs: list[str] = []
        for pname, p in inspect.signature(fn).parameters.items():
            ann = p.annotation
            assert not isinstance(ann, str), f"{plugin_id}.{pname}: string annotation (from __future__ import?)"
            if isinstance(ann, type) and issubclass(ann, TensorDesc):
                assert not attrs, f"{plugin_id}: tensor {pname} after attributes"
                tensors.append(pname)
            else:
                assert ann in BUILTIN_ATTRS and pname not in ("outputs", "stream", "tactic"), (plugin_id, pname)
                attrs.append(pname)
        n_out = _desc_tuple(inspect.signature(fn).return_annotation, f"{plugin_id} return")
        SCHEMA[plugin_id] = (tensors, attrs, n_out)
        REGISTERED[plugin_id] = fn
        return fn
    return inner


def aot_impl(plugin_id: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def inner(fn: Callable[..., Any]) -> Callable[..., Any]:
        assert plugin_id in SCHEMA and plugin_id not in AOT, plugin_id
        tensors, attrs, n_out = SCHEMA[plugin_id]
        sig = inspect.signature(fn)
        assert list(sig.parameters) == tensors + attrs + ["outputs", "tactic"], (plugin_id, list(sig.parameters))
        assert _desc_tuple(sig.parameters["outputs"].annotation, f"{plugin_id} outputs") == n_out
        ret = sig.return_annotation
        assert typing.get_origin(ret) is tuple and len(typing.get_args(ret)) == 4, (plugin_id, ret)
        a = typing.get_args(ret)
        assert all(x in (str, bytes) for x in a[:2]), ret
        assert issubclass(a[2], KernelLaunchParams) and issubclass(a[3], SymExprs), ret
        AOT[plugin_id] = fn
        return fn
    return inner


def install() -> None:
    """Put fake `tensorrt` and `tensorrt.plugin` modules into sys.modules."""
    trt = types.ModuleType("tensorrt")
    for name in ("float32", "float16", "bfloat16", "int32", "int64"):
        setattr(trt, name, name)
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.TensorDesc = TensorDesc
    trtp.KernelLaunchParams = KernelLaunchParams
    trtp.SymInt32 = SymInt32
    trtp.SymIntExprs = SymIntExprs
    trtp.SymExprs = SymExprs
    trtp.register = register
    trtp.aot_impl = aot_impl
    trtp.from_shape_expr = lambda shape, dtype: TensorDesc(tuple(int(d) for d in shape), dtype)
    trt.plugin = trtp
    sys.modules["tensorrt"] = trt
    sys.modules["tensorrt.plugin"] = trtp
