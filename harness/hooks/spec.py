"""What a run asks of its hooks: the ``--hooks`` grammar and the ``HookSet`` it parses to.

Imports neither torch nor nvtx, so a command line can check ``--hooks`` before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Literal

import msgspec

from harness.errors import HarnessError

NAMES: tuple[str, ...] = ("nvtx", "dispatch", "trace", "profile", "capture")
DEFAULT_PROFILE = (5, 5)
DEFAULT_PROFILE_EPOCH = 1
DEFAULT_CAPTURE_BUDGET = 256 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_budget(text: str) -> int:
    """``"256M"`` → bytes (binary units; ``K``/``M``/``G``, optional ``iB``/``B``)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    number = t[: len(t) - len(unit)]
    try:
        v = float(number)
    except ValueError:
        raise HarnessError(f"--hooks: bad capture budget {text!r} (e.g. 64M, 1.5G, 4096)") from None
    if not 0 <= v < float("inf"):
        raise HarnessError(f"--hooks: capture budget must be a finite size ≥ 0 (got {text!r})")
    return int(v * _UNITS[unit])


def format_budget(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


class HookSet(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Which hooks a run asked for; ``items()`` is the canonical spelling (manifest, worker specs)."""

    nvtx: bool = False
    dispatch: Literal["off", "full", "summary"] = "off"
    trace: bool = False
    profile: tuple[int, int] | None = None
    profile_epoch: int = DEFAULT_PROFILE_EPOCH
    capture: int | None = None  # byte budget; None = off

    def items(self) -> tuple[str, ...]:
        out = []
        if self.nvtx:
            out.append("nvtx")
        if self.dispatch == "full":
            out.append("dispatch")
        elif self.dispatch == "summary":
            out.append("dispatch=summary")
        if self.trace:
            out.append("trace")
        if self.profile is not None:
            a, b = self.profile
            win = f"{a}" if a == b else f"{a}:{b}"
            out.append(f"profile={win}" + (f"@{self.profile_epoch}" if self.profile_epoch != DEFAULT_PROFILE_EPOCH else ""))
        if self.capture is not None:
            out.append("capture" if self.capture == DEFAULT_CAPTURE_BUDGET else f"capture={format_budget(self.capture)}")
        return tuple(out)

    def __str__(self) -> str:
        return ",".join(self.items())

    @property
    def any(self) -> bool:
        return bool(self.items())

    def to_dict(self) -> dict[str, Any]:
        return msgspec.json.decode(msgspec.json.encode(self))  # plain JSON types (lists, not tuples)


def _int(text: str, item: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise HarnessError(f"--hooks: bad number {text!r} in {item!r}") from None
    if v < 0:
        raise HarnessError(f"--hooks: negative number in {item!r}")
    return v


def _profile(value: str | None, item: str) -> tuple[tuple[int, int], int]:
    if value is None:
        return DEFAULT_PROFILE, DEFAULT_PROFILE_EPOCH
    window, _, epoch_text = value.partition("@")
    epoch = _int(epoch_text, item) if epoch_text else DEFAULT_PROFILE_EPOCH
    a_text, sep, b_text = window.partition(":")
    a = _int(a_text, item)
    b = _int(b_text, item) if sep else a
    if b < a:
        raise HarnessError(f"--hooks: profile window {a}:{b} ends before it starts")
    return (a, b), epoch


def parse_hooks(spec: str | Iterable[str] | HookSet | None) -> HookSet:
    """Parse ``"nvtx,dispatch,profile=5:7"`` (or an iterable of such items, or a HookSet).
    Anything unknown or malformed is a one-line HarnessError."""
    if spec is None:
        return HookSet()
    if isinstance(spec, HookSet):
        return spec
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in str(s).split(",")]
    fields: dict[str, Any] = {}
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        name, eq, value = item.partition("=")
        name = name.strip().lower()
        value = value.strip() if eq else None
        if name not in NAMES:
            raise HarnessError(f"unknown hook {name!r} in --hooks (known: {', '.join(NAMES)})")
        if name in fields:
            raise HarnessError(f"--hooks: {name!r} given more than once")
        if name in ("nvtx", "trace"):
            if value is not None:
                raise HarnessError(f"--hooks: {name!r} takes no value (got {item!r})")
            fields[name] = True
        elif name == "dispatch":
            mode = value or "full"
            if mode not in ("full", "summary"):
                raise HarnessError(f"--hooks: dispatch mode must be 'full' or 'summary' (got {value!r})")
            fields["dispatch"] = mode
        elif name == "capture":
            fields["capture"] = DEFAULT_CAPTURE_BUDGET if value is None else parse_budget(value)
        else:
            fields["profile"], fields["profile_epoch"] = _profile(value, item)
    return HookSet(**fields)


#: What the driver's hooks did (the trace), beside the workers' ``hooks.<role><rank>.json``.
DRIVER_REPORT = "hooks.driver.json"


def path_bytes(p: Path) -> int:
    """Bytes a hook wrote to ``p`` (a directory's total; 0 when it is not there)."""
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.exists() else 0
