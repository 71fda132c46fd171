"""Pure, device-free measurement: the event schema, derived figures, statistics, numeric gates and
``summary.json``. Imports nothing of the harness outside this package, so a run directory can be
judged anywhere numpy and msgspec are installed.

- ``events``: ``ChunkEvent`` / ``SessionStart`` records, ``events.jsonl`` / ``sessions.jsonl``, ordering checks.
- ``metrics``: delivery intervals, FPS, TTFC, rollout, handoff, stage durations, blocked time.
- ``stats``: nearest-rank percentiles, session-block bootstrap, A/B ratio and verdict.
- ``gates``: saved outputs layout and the exact / threshold gates.
- ``summary``: builds and writes ``summary.json``.
"""
