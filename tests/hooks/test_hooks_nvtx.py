"""NVTX ranges through a recording backend: the expected ranges when on, no call at all when off."""

import threading

import pytest

from harness.hooks.active import activate
from harness.hooks import context as hctx
from harness.hooks import nvtx_ranges


@pytest.fixture(autouse=True)
def _clean():
    yield
    nvtx_ranges.disable()
    hctx.reset_for_tests()


def engine_like_loop(chunks=2, steps=5, layers=2):
    """What a worker and the engine do: session → chunk/stage → step → layer → attention core."""
    with hctx.phase(session=1, epoch=1):
        for c in range(chunks):
            with hctx.phase(chunk=c, stage="dit"):
                for s in range(steps):
                    with hctx.phase(step=s if s < 4 else "commit"):
                        for i in range(layers):
                            if hctx.ACTIVE:  # the guard hot loops may use
                                with hctx.phase(layer=i), hctx.phase(role="self_attention"):
                                    pass
            with hctx.phase(chunk=c, stage="decode"):
                with nvtx_ranges.range("halo exchange"):
                    pass


def test_ranges_when_on():
    rec = nvtx_ranges.RecordingBackend()
    nvtx_ranges.enable(rec)
    engine_like_loop(chunks=1, steps=5, layers=2)
    names = rec.pushed()
    assert names[:4] == ["session 1 epoch 1", "chunk 0 dit", "step 0", "layer 0"]
    assert names.count("layer 1") == 5 and names.count("self_attention") == 10
    assert "commit" in names and "step 4" not in names
    assert names[-2:] == ["chunk 0 decode", "halo exchange"]
    assert len(names) == 1 + 1 + 5 + 2 * 5 * 2 + 1 + 1
    cats = {c[1]: c[2] for c in rec.calls if c[0] == "push"}
    assert cats["chunk 0 dit"] == "chunk" and cats["layer 0"] == "layer" and cats["step 0"] == "step"
    assert rec.balanced()


def test_no_call_at_all_when_off():
    rec = nvtx_ranges.RecordingBackend()
    nvtx_ranges.enable(rec)
    nvtx_ranges.disable()
    assert not nvtx_ranges.ENABLED and not hctx.ACTIVE
    engine_like_loop()
    assert rec.calls == []
    # the off path hands out shared singletons: no object is even built per call
    assert nvtx_ranges.range("x") is nvtx_ranges.range("y")
    assert hctx.phase(chunk=1) is hctx.phase(layer=2)


def test_ranges_are_per_thread_and_balanced():
    rec = nvtx_ranges.RecordingBackend()
    nvtx_ranges.enable(rec)
    barrier = threading.Barrier(3)  # alive together, so thread idents are distinct

    def work():
        barrier.wait()
        engine_like_loop()
        barrier.wait()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.balanced()
    assert len({c[3] for c in rec.calls}) == 3


def test_pop_even_when_the_scope_raises():
    rec = nvtx_ranges.RecordingBackend()
    nvtx_ranges.enable(rec)
    with pytest.raises(RuntimeError):
        with hctx.phase(chunk=0):
            raise RuntimeError("boom")
    assert rec.balanced() and hctx.current() == hctx.EMPTY


def test_real_nvtx_backend_runs_without_a_profiler():
    backend = nvtx_ranges.enable()
    assert isinstance(backend, nvtx_ranges.NvtxBackend)
    real, calls = backend._domain, []

    class Spy:  # the real nvtx domain underneath, its push/pop calls counted
        def get_event_attributes(self, **kw):
            return real.get_event_attributes(**kw)

        def push_range(self, attrs):
            calls.append("push")
            real.push_range(attrs)

        def pop_range(self):
            calls.append("pop")
            real.pop_range()

    backend._domain = Spy()
    engine_like_loop(chunks=1, steps=1, layers=1)
    assert calls.count("push") == calls.count("pop") > 0
    assert {("chunk 0 dit", "chunk"), ("step 0", "step"), ("halo exchange", "range")} <= set(backend._attrs)


def test_activate_switches_nvtx_on_and_off(tmp_path):
    rec = nvtx_ranges.RecordingBackend()
    with activate("nvtx", out_dir=tmp_path, nvtx_backend=rec) as active:
        engine_like_loop(chunks=1, steps=1, layers=1)
    assert rec.pushed() and rec.balanced()
    n = len(rec.calls)
    engine_like_loop()
    assert len(rec.calls) == n and not hctx.ACTIVE
    rep = active.report()["nvtx"]  # what the hook did, measured: ranges pushed and their cost
    assert rep["ranges"] == len(rec.pushed()) > 0 and rep["push_pop_ms"] > 0


def test_compiled_regions_stay_compiled_with_hooks_on():
    """Inside a region dynamo traces, phases are dropped instead of breaking the graph (which
    would make dynamo run the whole function eagerly); scopes around it still emit ranges."""
    import torch
    from torch._dynamo.utils import counters

    rec = nvtx_ranges.RecordingBackend()
    nvtx_ranges.enable(rec)

    def block(x):
        with hctx.phase(role="self_attention"), nvtx_ranges.range("inside"):
            y = x @ x
        return y.relu()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    with hctx.phase(layer=0):
        compiled(torch.randn(4, 4))
    assert counters["stats"]["unique_graphs"] == 1
    assert rec.pushed() == ["layer 0"] and rec.balanced()
    torch._dynamo.reset()
