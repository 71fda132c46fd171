"""Every adaptation to the installed vLLM-Omni, each with its reason, in one place.

vLLM-Omni's LingBot-World modules are written for its own GPU worker processes. To run them on
CPU (tests, CI, the tiny preset) or inside the harness's DiT worker, a few things must be set up
or worked around; each is a function below. An unsupported version is refused by name: the
workarounds are facts about one release, not about the project.

Adaptations (vLLM-Omni 0.30.0 / vLLM 0.30.0):

* ``import_lingbot`` — importing ``vllm_omni.diffusion.models.lingbot_world.<module>`` runs the
  package ``__init__``, which imports the whole pipeline and through it torchvision (its PyPI
  build needs a CUDA torch and breaks the import on a CPU torch). The transformer, DMD-block,
  camera and actions modules do not need the pipeline, so the package object is registered
  without running its ``__init__`` and only those modules are imported.
* ``install_cpu_platform`` — with no GPU, vLLM-Omni resolves ``UnspecifiedOmniPlatform``, which
  has no diffusion attention backend (it raises NotImplementedError). The CPU platform chooses
  vLLM-Omni's own SDPA backend and gloo for collectives.
* ``CpuSDPABackend`` — vLLM-Omni's SDPA implementation dispatches per platform and has no CPU
  branch; the CPU backend routes to the same torch SDPA path the CUDA branch uses.
* ``fix_rotary`` — ``RotaryEmbeddingWan.forward_native`` (the non-CUDA path) multiplies
  ``[B, S, H, D/2]`` by ``[S, D/2]`` cos/sin without a head axis, which fails to broadcast (or
  silently pairs S with H when S == H): an upstream bug. The fix inserts the head axis and calls
  their own implementation.
* ``init_distributed`` — the transformer's layers look up vLLM's tensor-parallel group and
  vLLM-Omni's sequence-parallel group when they are built. On CPU the process group is gloo,
  created first (a TCP rendezvous), then vLLM-Omni's distributed and model-parallel state on it,
  under a current vLLM config whose device is the CPU.
* ``import_video_handler`` — the realtime video handler's module
  (``vllm_omni.entrypoints.openai.serving_video_output_stream``) sits in a package whose
  ``__init__`` imports the whole API server, and it imports ``AsyncOmni`` (a type annotation only)
  from ``entrypoints.async_omni``, which imports the engine and through its pipeline registry
  torchvision, as above. The package is registered without its ``__init__``, and ``async_omni``
  is a placeholder while the handler module is imported (removed from ``sys.modules`` after).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import socket
import sys
import types
from typing import Any

from harness.errors import HarnessError

# vllm, vllm_omni and torch.distributed are imported inside the functions that use them: vllm is an
# optional extra that takes 30-60 s to import, and this module is imported by the command line's
# option checks (engine.backends), which keep torch out of ``--help``.

#: (vllm, vllm-omni) versions these adaptations were written for and tested with.
SUPPORTED = {"vllm": "0.30.0", "vllm-omni": "0.30.0"}
INSTALL_HINT = "pip install -e '.[vllm]' (then: pip uninstall -y torchvision torchaudio torchcodec)"
_LINGBOT = "vllm_omni.diffusion.models.lingbot_world"
_MODULES = ("transformer", "dmd_block", "camera", "actions")
_state: dict[str, Any] = {}


def installed_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in SUPPORTED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def check_installed() -> None:
    """One-line refusal when the extra is absent or another version is installed (no import of
    vllm itself: this runs in the CLI before any process starts)."""
    found = installed_versions()
    missing = [d for d, v in found.items() if v is None]
    if missing:
        raise HarnessError(f"the vllm-omni engine needs {', '.join(missing)}: {INSTALL_HINT}")
    wrong = [f"{d} {found[d]} (supported: {v})" for d, v in SUPPORTED.items() if found[d] != v]
    if wrong:
        raise HarnessError(f"unsupported version: {'; '.join(wrong)}; install the supported one with {INSTALL_HINT}")


def available() -> bool:
    try:
        check_installed()
    except HarnessError:
        return False
    return True


def import_lingbot() -> types.SimpleNamespace:
    """vLLM-Omni's LingBot-World transformer, dmd_block, camera and actions modules (cached)."""
    if "lingbot" in _state:
        return _state["lingbot"]
    check_installed()
    install_cpu_platform()
    _package_without_init(_LINGBOT)
    mods = {name: importlib.import_module(f"{_LINGBOT}.{name}") for name in _MODULES}
    _state["lingbot"] = types.SimpleNamespace(**mods)
    return _state["lingbot"]


def _package_without_init(name: str) -> None:
    """Register package ``name`` (its directory found through its parent) without running its
    ``__init__``, so its submodules import alone (see the module docstring)."""
    if name in sys.modules:
        return
    parent_name, _, leaf = name.rpartition(".")
    parent = importlib.util.find_spec(parent_name)
    if parent is None or parent.submodule_search_locations is None:
        raise HarnessError(f"{parent_name} not found in the installed vllm-omni")
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(p, leaf) for p in parent.submodule_search_locations]
    sys.modules[name] = pkg


def import_video_handler() -> type:
    """vLLM-Omni's own ``OmniStreamingVideoOutputHandler`` (cached); see the module docstring."""
    if "video_handler" in _state:
        return _state["video_handler"]
    check_installed()
    package, placeholder = "vllm_omni.entrypoints.openai", "vllm_omni.entrypoints.async_omni"
    _package_without_init(package)
    own = placeholder not in sys.modules
    if own:
        stub = types.ModuleType(placeholder)
        stub.AsyncOmni = type("AsyncOmni", (), {})  # the handler names it in an annotation only
        sys.modules[placeholder] = stub
    try:
        mod = importlib.import_module(f"{package}.serving_video_output_stream")
    finally:
        if own:
            del sys.modules[placeholder]
    _state["video_handler"] = mod.OmniStreamingVideoOutputHandler
    return _state["video_handler"]


def _sdpa_classes() -> tuple[type, type]:
    from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl  # optional extra

    class CpuSDPAImpl(SDPAImpl):
        def forward(self, query, key, value, attn_metadata=None):
            return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")

    class CpuSDPABackend(SDPABackend):
        @staticmethod
        def get_impl_cls():
            return CpuSDPAImpl

    return CpuSDPABackend, CpuSDPAImpl


def __getattr__(name: str):
    # vLLM-Omni loads an attention backend by its dotted path; this resolves the CPU one lazily
    # (defining it at import time would import vllm with the harness).
    if name == "CpuSDPABackend":
        if "sdpa" not in _state:
            _state["sdpa"] = _sdpa_classes()
        return _state["sdpa"][0]
    raise AttributeError(name)


def install_cpu_platform() -> None:
    """Make vLLM-Omni's current platform the CPU one (SDPA attention, gloo) before any of its
    diffusion modules import it, unless a real device platform was detected."""
    if "platform" in _state:
        return
    import vllm_omni.platforms as plat  # optional extra
    from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

    current = plat.current_omni_platform
    if type(current) is UnspecifiedOmniPlatform:

        class CpuOmniPlatform(UnspecifiedOmniPlatform):
            dist_backend = "gloo"

            @classmethod
            def get_diffusion_attn_backend_cls(cls, selected_backend, head_size, allow_trtllm_default=False):
                return f"{__name__}.CpuSDPABackend"

            @classmethod
            def get_device_count(cls) -> int:
                return 1

            @classmethod
            def set_device(cls, device) -> None:
                pass

        current = CpuOmniPlatform()
        plat._current_omni_platform = current
    _state["platform"] = current


def fix_rotary(model) -> int:
    """Give every ``RotaryEmbeddingWan`` of ``model`` the head axis its native path lacks; returns
    how many were fixed (their CUDA path is left alone)."""
    from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan  # optional extra

    n = 0
    for mod in model.modules():
        if isinstance(mod, RotaryEmbeddingWan) and mod._forward_method == mod.forward_native:
            native = mod.forward_native
            mod._forward_method = lambda x, cos, sin, _f=native: _f(x, cos.unsqueeze(-2), sin.unsqueeze(-2))
            n += 1
    return n


def init_distributed(*, rank: int = 0, world_size: int = 1, init_method: str | None = None) -> None:
    """gloo process group, then vLLM-Omni's distributed and model-parallel state on it (once per
    process). SP > 1 is refused: vLLM-Omni's Ulysses all-to-all needs NCCL."""
    import torch.distributed as dist  # not at import: the command line imports this module without torch

    if world_size != 1:
        raise HarnessError("the vllm-omni engine runs SP=1 on CPU: vLLM-Omni's sequence parallelism needs NCCL (GPUs)")
    if "dist" in _state:
        return
    install_cpu_platform()
    from vllm_omni.diffusion.distributed import parallel_state as ps  # optional extra

    if init_method is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    with vllm_config():
        ps.init_distributed_environment(world_size=world_size, rank=rank, distributed_init_method=init_method,
                                        local_rank=rank, backend="gloo")
        ps.initialize_model_parallel(sequence_parallel_size=1, ulysses_degree=1, backend="gloo")
    _state["dist"] = True


def shutdown_distributed() -> None:
    """Undo ``init_distributed`` (tests share a process with others that build their own groups)."""
    if not _state.pop("dist", None):
        return
    import torch.distributed as dist  # not at import: the command line imports this module without torch
    from vllm_omni.diffusion.distributed import parallel_state as ps  # optional extra

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def vllm_config():
    """A current vLLM config whose device is the CPU (layers read it while they are built)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # optional extra

    cfg = _state.get("vllm_config")
    if cfg is None:
        cfg = _state["vllm_config"] = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        yield cfg
