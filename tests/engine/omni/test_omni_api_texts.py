"""The server of ``--api vllm-omni`` restates production's wire (harness/serving/omni_protocol):
its limits equal the installed handler's constants, and every error text it calls production's
occurs verbatim in the handler's source, so a drift in a vLLM-Omni upgrade fails here."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from harness.serving import omni_protocol as O

PRODUCTION_TEXTS = ("START_TIMEOUT", "START_TOO_LARGE", "START_BAD_JSON", "START_NOT_OBJECT", "EXPECTED_START",
                    "BAD_FORMAT", "INVALID_START", "MODEL_MISMATCH", "STALL", "CONTROL_TOO_LARGE", "CONTROL_BAD_JSON",
                    "CONTROL_NOT_OBJECT", "UNKNOWN_TYPE", "NO_INTERACTION", "BAD_EVENT_ID", "NO_EVENT", "EMPTY_EVENT",
                    "BAD_PROMPT", "BAD_MM", "BAD_MODALITY", "NO_NEGATIVE_PROMPT", "BAD_TRANSITION",
                    "NEGATIVE_TRANSITION", "EVENT_ID_CONFLICT", "INTERACTION_FAILED")


def _handler_source() -> str:
    """The installed handler's source, read rather than imported: importing it pulls vLLM-Omni's
    whole serving stack (torchvision included, which this CPU install removes)."""
    pkg = importlib.util.find_spec("vllm_omni")  # locates the package without running it
    return (Path(pkg.submodule_search_locations[0]) / "entrypoints" / "openai" / "serving_video_output_stream.py").read_text()


def _constants(src: str) -> dict:
    """The module-level NAME = <arithmetic> assignments of ``src``, evaluated."""
    return {n.targets[0].id: eval(compile(ast.Expression(n.value), "<handler>", "eval"), {})  # noqa: S307 - constants only
            for n in ast.parse(src).body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id.isupper()
            and isinstance(n.value, (ast.Constant, ast.BinOp))}


def test_limits_are_the_installed_handlers(extra):
    src = _handler_source()
    c = {k.lstrip("_"): v for k, v in _constants(src).items()}
    assert (O.START_TIMEOUT_S, O.STALL_TIMEOUT_S) == (c["DEFAULT_START_TIMEOUT"], c["DEFAULT_STALL_TIMEOUT"])
    assert (O.MAX_START_MESSAGE_CHARS, O.MAX_CONTROL_MESSAGE_CHARS) == (c["MAX_START_MESSAGE_SIZE"], c["MAX_CONTROL_MESSAGE_SIZE"])
    assert O.PATH in src and f'"{O.FORMAT}"' in src


def test_every_production_text_is_the_installed_handlers(extra):
    src = _handler_source()
    for name in PRODUCTION_TEXTS:
        text = getattr(O, name)
        # a text with a placeholder: its fixed part, as production's f-string spells it
        fixed = text.split("{")[0] if "{" in text else text
        assert fixed and fixed in src, f"{name}: {text!r} is not in vLLM-Omni's handler"
