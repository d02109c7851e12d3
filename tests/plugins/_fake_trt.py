"""A minimal stand-in for `tensorrt` + `tensorrt.plugin` (QDP) so registration code runs without TensorRT.

Records every @register / @aot_impl function; shape expressions are plain ints wrapped so that `is_constant`
and `constant_value` exist. Only what plugins/*/trt.py touches is modelled; anything else raises.
"""
from __future__ import annotations

import sys
import types
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


@dataclass
class SymIntExprs:
    items: list = field(default_factory=list)

    @classmethod
    def from_tuple(cls, items: Any) -> "SymIntExprs":
        return cls(list(items))


REGISTERED: dict[str, Callable[..., Any]] = {}
AOT: dict[str, Callable[..., Any]] = {}


def _deco(table: dict[str, Callable[..., Any]]) -> Callable[[str], Callable[[Callable[..., Any]], Callable[..., Any]]]:
    def outer(plugin_id: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def inner(fn: Callable[..., Any]) -> Callable[..., Any]:
            assert plugin_id not in table, f"{plugin_id} registered twice"
            table[plugin_id] = fn
            return fn
        return inner
    return outer


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
    trtp.register = _deco(REGISTERED)
    trtp.aot_impl = _deco(AOT)
    trtp.from_shape_expr = lambda shape, dtype: TensorDesc(tuple(int(d) for d in shape), dtype)
    trt.plugin = trtp
    sys.modules["tensorrt"] = trt
    sys.modules["tensorrt.plugin"] = trtp
