"""What inductor's cudagraph trees recorded, and what they copy into each recorded graph at replay.

A recorded CUDA graph reads its inputs at the addresses it was recorded with. An input that is not
static (a parameter, a buffer, a tensor marked ``mark_static_address``, or an output of an earlier
graph of the same tree) is copied into the graph's own input buffer before every replay, in one
``_foreach_copy_`` per graph (the ``multi_tensor_apply`` kernels of a kernel table). This module
names those inputs — by the source line that first uses each — and counts the graphs that copy
them, so a kernel table's copies can be traced back to code: H1d came from exactly this question.

The trees are an internal API of inductor; every reader here answers ``None`` when it has moved.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterable

import torch


def tree_nodes(device: torch.device) -> list[Any] | None:
    """Every node (one recorded CUDA graph) of the device's cudagraph trees; None when the
    internal API changed."""
    try:  # imported here: 0.85 s that only CUDA-graph runs pay, and an internal API that may move
        from torch._inductor import cudagraph_trees as trees

        mgr = trees.get_manager(device.index or 0, create_if_none_exists=False)
        if mgr is None:
            return []
        out, todo = [], [node for nodes in mgr.roots.values() for node in nodes]
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(c for cs in node.children.values() for c in cs)
        return out
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def use_site(stack_trace: str | None) -> str | None:
    """The innermost frame of an FX stack trace as ``file.py:line fn: code`` (the file's base name)."""
    frames = _FRAME.findall(stack_trace or "")
    if not frames:
        return None
    path, line, fn, code = frames[-1]
    return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line} {fn}: {code.strip()}"


def _where(placeholder: Any) -> str:
    """A graph input named by the first source line that uses it (its own trace, else its users')."""
    traces = [getattr(placeholder, "stack_trace", None)]
    traces += [getattr(u, "stack_trace", None) for u in getattr(placeholder, "users", ())]
    site = next((s for s in map(use_site, traces) if s), None)
    name = getattr(placeholder, "name", "?")
    return f"{name} used at {site}" if site else f"{name} (no source line)"


def input_copies(nodes: Iterable[Any]) -> list[dict]:
    """Per copied input (named by ``_where``), the recorded graphs that copy it at every replay,
    most first; a graph with no copied input adds nothing."""
    counts: Counter[str] = Counter()
    for node in nodes:
        placeholders = node.wrapped_function.placeholders
        for i in node.non_static_input_idx:
            counts[_where(placeholders[i]) if i < len(placeholders) else f"input {i} (no placeholder)"] += 1
    return [{"input": what, "graphs": n} for what, n in counts.most_common()]


def report(device: torch.device) -> dict:
    """``cudagraphs_recorded`` (the graphs recorded on the device) and ``cudagraph_input_copies``
    (``input_copies`` of them), from one walk of the trees; each None when the internal API moved."""
    nodes = tree_nodes(device)
    if nodes is None:
        return {"cudagraphs_recorded": None, "cudagraph_input_copies": None}
    try:
        copies = input_copies(nodes)
    except AttributeError:  # a node without the fields read above: the API moved
        copies = None
    return {"cudagraphs_recorded": len(nodes), "cudagraph_input_copies": copies}
