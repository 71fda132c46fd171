"""The cudagraph input-copy report names each copied input by the source line that uses it.

CUDA graphs cannot be recorded on a CPU, so the tree nodes are stand-ins with the two fields the
report reads from inductor's ``CUDAGraphNode``; the placeholders are the real thing, taken from a
graph dynamo traced here, so the stack traces have dynamo's own format."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch._inductor.cudagraph_utils import get_placeholder_info

from harness.engine import graph_inputs


def _placeholders():
    seen = []

    def backend(gm, example_inputs):
        seen.append(get_placeholder_info(gm.graph))
        return gm.forward

    def block(x, scale, shift):
        y = x * 2.0
        return torch.addcmul(shift, y, scale + 1)  # the line the report must name

    torch._dynamo.reset()
    torch.compile(block, backend=backend, dynamic=False)(torch.ones(4), torch.ones(4), torch.zeros(4))
    torch._dynamo.reset()
    (placeholders,) = seen
    return placeholders


def _node(placeholders, copied):
    return SimpleNamespace(wrapped_function=SimpleNamespace(placeholders=tuple(placeholders)),
                           non_static_input_idx=list(copied))


def test_copied_inputs_are_named_by_the_line_that_uses_them_and_counted_per_graph():
    ph = _placeholders()
    names = [p.name for p in ph]
    assert len(ph) == 3, names
    # scale and shift copied into three graphs, x into one; a graph that copies nothing adds nothing
    nodes = [_node(ph, [1, 2]), _node(ph, [1, 2]), _node(ph, [1, 2]), _node(ph, [0]), _node(ph, [])]
    rows = graph_inputs.input_copies(nodes)
    assert [r["graphs"] for r in rows] == [3, 3, 1]
    by_name = {r["input"].split(" ")[0]: r for r in rows}
    assert set(by_name) == set(names)
    scale = by_name[names[1]]["input"]
    assert "test_graph_inputs.py:" in scale and "block: return torch.addcmul(shift, y, scale + 1)" in scale
    assert "y = x * 2.0" in by_name[names[0]]["input"]


def test_an_input_index_past_the_placeholders_is_reported_not_dropped():
    rows = graph_inputs.input_copies([_node([], [5])])
    assert rows == [{"input": "input 5 (no placeholder)", "graphs": 1}]


def test_use_site_reads_the_innermost_frame():
    trace = ('  File "/a/b/outer.py", line 3, in run\n    inner()\n'
             '  File "C:\\x\\dit.py", line 361, in forward\n    x = torch.addcmul(a, b, c)\n')
    assert graph_inputs.use_site(trace) == "dit.py:361 forward: x = torch.addcmul(a, b, c)"
    assert graph_inputs.use_site(None) is None and graph_inputs.use_site("no frames here") is None


def test_without_cuda_graphs_the_trees_report_nothing_recorded():
    # no tree manager exists in a process that recorded no CUDA graph (None would mean the
    # internal API moved, which this torch must not show)
    assert graph_inputs.report(torch.device("cpu")) == {"cudagraphs_recorded": 0, "cudagraph_input_copies": []}
