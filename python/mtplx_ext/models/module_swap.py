"""`swap_modules`: replaces modules of an nn.Module tree in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.nn as nn


def swap_modules(model: nn.Module, replace: Callable[[Any], nn.Module | None]) -> int:
    """Replaces, in place, every value below `model` for which `replace` gives a module.

    Walks the module tree (an nn.Module is a dict of arrays and children;
    lists and tuples of children included). A value referenced twice is
    replaced once and its replacement referenced twice; replacements are not
    walked into. The root itself is never replaced.

    Returns:
        How many distinct values were replaced.

    Raises:
        TypeError: model is not an nn.Module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    swapped: dict[int, nn.Module] = {}
    visited: set[int] = set()

    def replacement(value: Any) -> nn.Module | None:
        if id(value) in swapped:
            return swapped[id(value)]
        new = replace(value)
        if new is not None:
            swapped[id(value)] = new
        return new

    def walk(node: Any) -> None:
        if id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, (dict, list)):  # nn.Module is a dict
            keys = list(node.keys()) if isinstance(node, dict) else range(len(node))
            for key in keys:
                child = node[key]
                new = replacement(child)
                if new is not None:
                    node[key] = new
                elif isinstance(child, tuple):
                    items = [c if (r := replacement(c)) is None else r for c in child]
                    if any(a is not b for a, b in zip(items, child)):
                        node[key] = tuple(items)
                    for c in node[key]:
                        walk(c)
                else:
                    walk(child)

    walk(model)
    return len(swapped)


__all__ = ["swap_modules"]
