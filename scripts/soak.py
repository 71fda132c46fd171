"""Soak ``serve --listen`` (issue 28): N sessions (default 210) through the WebSocket with
disconnects mixed in (harness.experiments.soak), then the checks: true outcomes recorded, resident
memory drift ≤ 1 % between the first and last thirds (their medians; each process's own drift
printed beside), nothing left behind. Exit 1 on a problem.

    python scripts/soak.py [--sessions 210] [--chunks 2] [--out DIR] [--series]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from harness.experiments import soak
from harness.experiments.scenario import ServerProcess


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=210)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--out", help="the server's run directory (default: a new temporary directory)")
    ap.add_argument("--series", action="store_true", help="print each process's resident MiB after every session")
    args = ap.parse_args()
    if args.sessions < 3 or args.chunks < 1:
        print("error: --sessions must be ≥ 3 and --chunks ≥ 1", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="soak-")) / "run"
    t0 = time.monotonic()
    server = ServerProcess(["--preset", "tiny", "--warmup-chunks", "0"], out)
    every = max(1, args.sessions // 10)
    res = soak.run(server, args.sessions, args.chunks,
                   progress=lambda i, s: i % every or print(f"  {i:4d} {s.kind:<12} {s.outcome:<12} rss {s.rss / 2**20:.0f} MiB", flush=True))
    counts = {k: sum(s.kind == k for s in res.sessions) for k in soak.KINDS}
    print(f"{len(res.sessions)} sessions in {time.monotonic() - t0:.0f} s: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    t, mib = res.total, 2**-20
    print(f"resident memory (server + workers, medians): first third {t.first * mib:.1f} MiB, "
          f"last third {t.last * mib:.1f} MiB, drift {100 * t.drift:+.3f} % (allowed {100 * soak.MAX_DRIFT:g} %)")
    for name, d in res.processes.items():
        print(f"  {name:<8} first third {d.first * mib:7.1f} MiB, last third {d.last * mib:7.1f} MiB, "
              f"drift {100 * d.drift:+.3f} %, range {d.low * mib:.1f}-{d.high * mib:.1f} MiB")
    if args.series:
        for name in res.processes:
            print(f"  {name:<8} " + " ".join(f"{s.rss_by_process[name] * mib:.0f}" for s in res.sessions))
    samples = out.parent / "soak.json"  # beside the run directory, not in it
    samples.write_text(json.dumps([{"kind": s.kind, "outcome": s.outcome, "session": s.session, "rss": s.rss,
                                    "rss_by_pid": s.rss_by_pid, "rss_by_process": s.rss_by_process} for s in res.sessions]))
    print(f"run directory: {out}; every session's samples: {samples}")
    for p in res.problems:
        print(f"  problem: {p}")
    print("ok: true outcomes recorded, nothing left behind" if not res.problems else f"{len(res.problems)} problems")
    return 1 if res.problems else 0


if __name__ == "__main__":
    sys.exit(main())
