"""The one table of figure definitions: every figure a person reads — in the console headline,
``summary.json``, ``report.md``, the plots and the README — is named, labelled and defined here.

A ``Figure`` says what is printed (``label``, the column header or headline label), how it is
computed (``formula``), its unit and the function that computes it (``where``, a dotted path under
``harness.measure``). ``keys`` are the fields that carry it in ``summary.json`` where it has one.
A label that must read differently under a scheduler (Case E's cpu_ready(i−1) → dit_start(i) is
not Case D's handoff) is given per scheduler in ``by_scheduler``; it is the same figure.

Writers call ``label(name)``/``define(name)`` instead of spelling a label, so a figure cannot be
printed under two names; ``resolve(text)`` maps any printed label back to its definition (tests
check every header and headline label of a run this way).
"""

from __future__ import annotations

import msgspec


class Figure(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    label: str
    formula: str
    unit: str
    where: str
    #: the fields of ``summary.json`` that carry it
    keys: tuple[str, ...] = ()
    by_scheduler: dict[str, str] = {}


NEAREST_RANK = "nearest rank: P_p is the ceil(p·n/100)-th smallest sample, so it actually occurred"

_TABLE: tuple[Figure, ...] = (
    # ---- what a row is about ------------------------------------------------------------
    Figure(name="boundary", label="boundary", unit="—", where="events.BOUNDARIES",
           formula="the timestamp (DESIGN §4) the row's figures are measured at"),
    Figure(name="stage", label="stage", unit="—", where="stages.STAGES",
           formula="a segment between two consecutive boundaries; the segments tile submit → delivered"),
    Figure(name="span", label="from → to", unit="—", where="stages.STAGES",
           formula="the two boundaries that open and close the stage"),
    Figure(name="blocked_stage", label="blocked stage", unit="—", where="metrics.blocked_time",
           formula="the producer that waited on a full queue or ring slot"),
    Figure(name="rank", label="#", keys=("rank",), unit="—", where="tails.slowest_samples",
           formula="1 = the slowest steady interval at the reference boundary"),
    Figure(name="epoch", label="epoch", keys=("epoch",), unit="—", where="events.ChunkEvent",
           formula="the session's epoch (epoch 0 is warm-up)"),
    Figure(name="chunk", label="chunk", keys=("chunk",), unit="—", where="events.ChunkEvent",
           formula="chunk index in its session, from 0"),
    # ---- counts -------------------------------------------------------------------------
    Figure(name="n", label="n", keys=("n",), unit="samples", where="metrics.Selection",
           formula="samples the figure was computed from (steady window, measured non-cancelled sessions)"),
    Figure(name="sessions", label="sessions", keys=("n_sessions",), unit="sessions", where="metrics.Selection.per_session",
           formula="measured, non-cancelled sessions that gave at least one sample"),
    Figure(name="expected", label="expected", keys=("expected",), unit="samples", where="metrics.Selection",
           formula="sample slots the rule asked for: measured non-cancelled sessions × window chunks"),
    Figure(name="skipped_missing", label="skipped (missing)", keys=("skipped_missing",), unit="samples",
           where="metrics.Selection", formula="slots left out because a boundary was not recorded (never interpolated)"),
    Figure(name="skipped_nonpositive", label="skipped (≤ 0)", keys=("skipped_nonpositive",), unit="samples",
           where="metrics.Selection", formula="durations that came out ≤ 0: an ordering fault, not a sample"),
    Figure(name="p99_is_max", label="*", keys=("p99_is_max",), unit="flag", where="stats.percentile",
           formula="fewer than 100 samples: the P99 shown is the maximum"),
    # ---- delivery interval and FPS ----------------------------------------------------
    Figure(name="interval_p50", label="interval P50 ms", keys=("p50_ms",), unit="ms", where="stats.nearest_rank",
           formula="median steady delivery interval B(i) − B(i−1), " + NEAREST_RANK),
    Figure(name="interval_p50_ci", label="P50 95 % CI", keys=("p50_ci_ms",), unit="ms", where="stats.bootstrap_percentile",
           formula="95 % percentile interval of the P50 by bootstrap over whole sessions (fixed seed)"),
    Figure(name="interval_p99", label="interval P99 ms", keys=("p99_ms",), unit="ms", where="stats.percentile",
           formula="99th percentile of the steady intervals, nearest rank; with n < 100 it is the maximum (marked *)"),
    Figure(name="interval_p99_ci", label="P99 95 % CI", keys=("p99_ci_ms",), unit="ms", where="stats.bootstrap_percentile",
           formula="95 % percentile interval of the P99 by bootstrap over whole sessions (fixed seed)"),
    Figure(name="interval_max", label="interval max ms", keys=("max_ms",), unit="ms", where="summary.dist",
           formula="the longest steady interval"),
    Figure(name="interval_min", label="interval min ms", keys=("min_ms",), unit="ms", where="summary.dist",
           formula="the shortest steady interval"),
    Figure(name="interval_mean", label="interval mean ms", keys=("mean_ms",), unit="ms", where="summary.dist",
           formula="mean steady interval"),
    Figure(name="fps_mean", label="FPS mean", keys=("fps_mean",), unit="frames/s", where="metrics.steady_fps",
           formula="Σ frames ÷ Σ intervals over the steady window = mean frames per chunk ÷ mean interval "
                   "(the rate a viewer sees; not frames ÷ P50)"),
    Figure(name="fps_median", label="FPS at interval P50", keys=("fps_median",), unit="frames/s",
           where="metrics.median_interval_fps",
           formula="frames(i) ÷ interval(i) of the one steady interval that is the interval P50 (nearest rank), so "
                   "the pair read off the same sample for even and odd n"),
    # ---- per-session figures ------------------------------------------------------------
    Figure(name="ttfc_p50", label="TTFC P50 ms", keys=("p50_ms", "ttfc_p50_ms"), unit="ms", where="metrics.ttfc",
           formula="B(chunk 0) − session start per measured session; median over sessions, " + NEAREST_RANK),
    Figure(name="ttfc_min", label="TTFC min ms", keys=("min_ms",), unit="ms", where="metrics.ttfc",
           formula="the shortest B(chunk 0) − session start over measured sessions"),
    Figure(name="ttfc_max", label="TTFC max ms", keys=("max_ms",), unit="ms", where="metrics.ttfc",
           formula="the longest B(chunk 0) − session start over measured sessions"),
    Figure(name="ttfc_parts", label="first chunk's parts P50 ms", keys=("ttfc_parts",), unit="ms", where="metrics.ttfc_parts",
           formula="per measured session, chunk 0's setup (session start → submit) and each stage it recorded (stages.STAGES); "
                   "the P50 of each over sessions, nearest rank. A session's parts add up to its TTFC at delivered; "
                   "the parts' P50s need not add up to the TTFC's P50"),
    Figure(name="rollout", label="rollout ms", keys=("time",), unit="ms", where="metrics.rollouts",
           formula="session start → B(last chunk) of a session with every chunk recorded"),
    Figure(name="rollout_fps", label="rollout FPS P50", keys=("fps_median",), unit="frames/s", where="metrics.rollouts",
           formula="nearest-rank median over sessions of all frames ÷ rollout time"),
    Figure(name="frames_per_session", label="frames per session", keys=("frames_per_session",), unit="frames",
           where="metrics.rollouts", formula="pixel frames of a whole session (first chunk 1 + 4·(latent − 1), then 4·latent)"),
    # ---- warm-up (compilation) -------------------------------------------------------------
    Figure(name="warmup_first_chunk", label="warm-up first chunk ms", keys=("first_ms", "steady_p50_ms"), unit="ms",
           where="summary.warmup_summary",
           formula="per compiled stage (dit, decode), its duration on chunk 0 of the first warm-up session, beside its "
                   "steady P50: in a compiled mode the difference is mostly compilation"),
    Figure(name="warmup_excess", label="warm-up excess ms", keys=("excess_ms",), unit="ms", where="metrics.excess_over",
           formula="Σ over the first warm-up session's chunks of (stage duration − its steady P50, when positive): "
                   "the time compilation and first-touch allocation added"),
    # ---- the setting line's two numbers (measure.setting) ---------------------------------
    Figure(name="host_load", label="host load", unit="processes", where="setting.setting_parts",
           formula="the host's 1-minute load average (os.getloadavg) when the run started → when it ended, beside "
                   "its CPU count (manifest host.load_start, host.load_end, host.cpus): above the CPU count, "
                   "every stage waits for a core"),
    Figure(name="hook_cost_in_run", label="ms in-run", unit="ms", where="setting.hook_cost_ms",
           formula="per hook, the time its own code took inside the timed work (overhead_ms.<hook>_in_run of every "
                   "process's hooks.<process>.json, summed over processes); what the hook cannot time itself "
                   "(e.g. a profiler's kernel slow-down) is not in it"),
    # ---- handoff ------------------------------------------------------------------------
    Figure(name="handoff_p50", label="handoff cpu_ready(i−1) → dit_start(i) P50 ms", keys=("p50_ms",), unit="ms",
           where="metrics.handoffs",
           formula="dit_start(i) − cpu_ready(i−1) on steady chunks, nearest-rank median; under Case D the "
                   "driver's reaction between a chunk's frames and the next DiT start",
           by_scheduler={"case-e": "DiT lead dit_start(i) − cpu_ready(i−1) P50 ms (Case E: negative while DiT(i) overlaps decode(i−1); not a handoff)"}),
    # ---- stages -------------------------------------------------------------------------
    Figure(name="stage_p50", label="P50 ms", keys=("p50_ms",), unit="ms", where="metrics.steady_stages",
           formula="nearest-rank median of the stage's duration over steady chunks"),
    Figure(name="stage_mean", label="mean ms", keys=("mean_ms",), unit="ms", where="metrics.steady_stages",
           formula="mean of the stage's duration over steady chunks"),
    Figure(name="stage_share", label="share of stage sum", keys=("share",), unit="%", where="metrics.stage_shares",
           formula="stage mean ÷ Σ of all stage means (sums to 100 % over the recorded stages)"),
    Figure(name="stage_of_interval", label="share of mean interval", keys=("share_of_interval",), unit="%",
           where="summary.stage_summaries",
           formula="stage mean ÷ mean steady interval at the reference boundary (sums to > 100 % when "
                   "stages of different chunks overlap, as under Case E)"),
    # ---- blocking -------------------------------------------------------------------------
    Figure(name="blocked_total", label="blocked total ms", keys=("total_ms",), unit="ms", where="metrics.blocked_time",
           formula="Σ time the producer spent blocked, every chunk of every measured session"),
    Figure(name="blocked_max", label="blocked max ms", keys=("max_ms",), unit="ms", where="metrics.blocked_time",
           formula="the longest block on one chunk"),
    Figure(name="chunks_blocked", label="chunks blocked", keys=("chunks_blocked",), unit="chunks", where="metrics.blocked_time",
           formula="chunks on which the producer blocked at all / chunks that recorded the stage"),
    Figure(name="blocked_mean", label="blocked mean ms per chunk", keys=("mean_ms_per_chunk",), unit="ms",
           where="summary.blocked_summaries", formula="blocked total ÷ chunks that recorded the stage"),
    Figure(name="blocked_chunks", label="chunks recorded", keys=("chunks",), unit="chunks", where="metrics.blocked_time",
           formula="chunks that recorded the stage at all (0 ns included)"),
    Figure(name="gpu_ms", label="GPU ms", keys=(), unit="ms", where="metrics.gpu_times",
           formula="CUDA-event duration of a stage on a steady chunk (P50 nearest rank, mean, max)"),
    # ---- long tail ------------------------------------------------------------------------
    Figure(name="slow_interval", label="interval ms", keys=("interval_ms",), unit="ms", where="tails.slowest_samples",
           formula="one slow steady interval B(i) − B(i−1) at the reference boundary"),
    Figure(name="slow_excess", label="+vs median", keys=("excess_ms",), unit="ms", where="tails.slowest_samples",
           formula="the interval − the median steady interval at the same boundary"),
    Figure(name="slow_grew", label="grew", keys=("grew",), unit="—", where="tails.slowest_samples",
           formula="the stage (segments + gap cpu_ready(i−1) → submit(i)) whose excess over its median is largest"),
    Figure(name="slow_first_late", label="first late", keys=("first_late",), unit="—", where="tails.slowest_samples",
           formula="the first boundary, data-flow order, already late by ≥ half the reference excess"),
    Figure(name="slow_lateness", label="lateness", keys=("lateness",), unit="ms", where="tails.slowest_samples",
           formula="per boundary B of the slow chunk, B(i) − R(i−1) (R the reference boundary) against its steady "
                   "median: what first late reads"),
    Figure(name="slow_stage_excess", label="stage excess ms", keys=("excess_ms",), unit="ms", where="tails.slowest_samples",
           formula="a stage's duration on the slow chunk − its median over steady chunks"),
    Figure(name="slow_ms", label="on the slow chunk ms", keys=("ms",), unit="ms", where="tails.slowest_samples",
           formula="a boundary's interval or a stage's duration on the slow chunk"),
    Figure(name="slow_median", label="median ms", keys=("median_ms",), unit="ms", where="tails.stage_medians",
           formula="the nearest-rank median of the same interval or stage over steady chunks: what a slow chunk is compared with"),
    Figure(name="session", label="session", keys=("session",), unit="—", where="events.ChunkEvent",
           formula="the session's index in the run"),
    Figure(name="interval_p95", label="interval P95 ms", unit="ms", where="stats.percentile",
           formula="95th percentile of the steady intervals, nearest rank; the maximum (marked *) while n < 20"),
    Figure(name="tail_percentiles", label="long-tail percentiles", keys=("p", "ms", "low_ms", "high_ms", "is_max"),
           unit="ms", where="tails.boundary_tail",
           formula="per boundary, for each p of tails.TAIL_PERCENTILES: the steady interval's P_p (ms, nearest rank, "
                   "so P50/P99 are interval P50/P99 ms), its 95 % session-bootstrap interval [low_ms, high_ms], "
                   "and is_max when too few samples made it the maximum"),
    Figure(name="culprits", label="culprits over the slowest", keys=("culprits",), unit="samples", where="tails.culprit_counts",
           formula="per stage, how many of the slowest samples it was the one that grew in"),
    Figure(name="slowest_requested", label="slowest requested", keys=("slowest_requested",), unit="samples",
           where="tails.TailSummary", formula="how many slowest samples the long-tail protocol was asked to break down"),
    # ---- beside production (report --against-production; production: DESIGN §12) -------------
    Figure(name="prod_figure", label="compared figure", unit="—", where="production.production_rows",
           formula="the run's figure the row compares, labelled as in this table (@ the boundary it is taken at)"),
    Figure(name="prod_ours", label="ours", unit="as the figure", where="production.production_rows",
           formula="this run's value of the row's figure"),
    Figure(name="prod_value", label="production (DESIGN §12)", unit="as the figure", where="production.PRODUCTION",
           formula="production's value at the run's resolution (lo–hi where it reported a range)"),
    Figure(name="prod_ratio", label="ours ÷ production", unit="×", where="production.row",
           formula="ours ÷ production (the range's midpoint)"),
    Figure(name="prod_advantage", label="× better", unit="×", where="production.row",
           formula="how many times better ours is in the figure's own direction (> 1: better): the ratio where higher "
                   "is better, its inverse where lower is"),
    Figure(name="prod_note", label="note", unit="—", where="production.production_rows",
           formula="what qualifies the row: GPU-event or host-observed time, the P99's CI, why a value is missing"),
    Figure(name="dit_p50", label="DiT P50 ms", unit="ms", where="production.production_rows",
           formula="stage P50 of dit (dit_start → dit_end): the DiT's time per chunk"),
    Figure(name="vae_segment_p50", label="VAE segment P50 ms (latent_ready → cpu_ready)", unit="ms",
           where="production.production_rows",
           formula="nearest-rank median over steady chunks of cpu_ready − latent_ready: wait, decode, convert and D2H"),
    Figure(name="decode_p50", label="VAE decode P50 ms", unit="ms", where="production.production_rows",
           formula="stage P50 of decode (decode_start → decode_end)"),
    Figure(name="ipc_p50", label="metadata IPC P50 ms (cpu_ready → received)", unit="ms", where="production.production_rows",
           formula="stage P50 of ipc: the slot's metadata from VAE rank 0 to the encoder"),
    Figure(name="all_gpu_idle_p50", label="all GPUs idle P50 ms per interval", unit="ms", where="metrics.all_gpu_idle",
           formula="per steady interval (cpu_ready(i−1), cpu_ready(i)], the host-observed time no GPU work of the "
                   "session was in flight; nearest-rank median"),
    Figure(name="dit_mfu", label="DiT MFU (bf16 dense)", unit="%", where="production.mfu",
           formula="DiT FLOPs of a steady chunk (bench-engine --json) ÷ GPU-event DiT P50 ÷ (bf16 dense peak × SP ranks)"),
    Figure(name="vae_mfu", label="VAE decode MFU (TF32 dense)", unit="%", where="production.mfu",
           formula="VAE conv FLOPs of a chunk (bench-engine --json) ÷ GPU-event decode P50 ÷ (TF32 dense peak × VAE ranks)"),
    # ---- the viewer's session table (client, harness API: serving/client.py) --------------------
    Figure(name="client_seed", label="seed", unit="—", where="playout.SESSION_COLUMNS",
           formula="the session's seed (--seed + the session's index in this client run)"),
    Figure(name="client_outcome", label="outcome", unit="—", where="playout.SESSION_COLUMNS",
           formula="how the session ended at the client: complete, cancelled, disconnected, error, busy (refused: "
                   "every replica busy and the admission queue full, or no queue), queue_timeout (queued, not "
                   "admitted within the client's start timeout) or closed"),
    Figure(name="client_chunks", label="chunks", unit="chunks", where="playout.SESSION_COLUMNS",
           formula="chunks received / chunks the session asked for"),
    Figure(name="client_frames", label="frames", unit="frames", where="playout.playout",
           formula="pixel frames received (and played out) in the session"),
    Figure(name="client_ttfc", label="TTFC ms", unit="ms", where="playout.session_ttfc_ms",
           formula="client clock: the first chunk's media read − the start sent (TTFC at the client's receipt, "
                   "before playout; the server's summary takes TTFC at its own boundaries)"),
    Figure(name="client_underruns", label="underruns", keys=("underruns",), unit="stalls", where="playout.playout",
           formula="times the player (started once its prebuffer arrived, then one frame per 1/fps) reached a frame "
                   "not yet arrived; consecutive late frames are one underrun"),
    Figure(name="client_stall", label="stall ms", unit="ms", where="playout.playout",
           formula="Σ time the player waited for late frames"),
    Figure(name="client_continuous", label="cont.play", unit="%", where="playout.playout",
           formula="continuous-play ratio: play time ÷ (play time + stall time); 100 % = never stalled"),
    Figure(name="client_read_fps", label="read fps", unit="frames/s", where="playout.read_fps",
           formula="frames of chunks 1… ÷ (last chunk's receipt − first chunk's receipt), client clock: the rate the "
                   "media arrived at (chunk 0 opens the span, so its frames are not counted)"),
    # ---- GPU telemetry (--telemetry HZ: NVML samples, measure.telemetry_figures) ----------------------
    Figure(name="energy_per_frame", label="energy J/frame", keys=("energy_per_frame_j",), unit="J/frame",
           where="telemetry_figures.summarize",
           formula="Σ over steady intervals (cpu_ready(i−1), cpu_ready(i)] and GPUs of ∫ power dt (trapezoid through the "
                   "NVML readings, interpolated at the interval's ends) ÷ Σ frames of those intervals; an interval the "
                   "readings do not cover is left out (intervals_uncovered)"),
    Figure(name="power_mean", label="GPU power mean W", keys=("power_mean_w",), unit="W", where="telemetry_figures.summarize",
           formula="the same energy ÷ Σ time of the same steady intervals: the mean power of all the run's GPUs together"),
    Figure(name="telemetry_gpus", label="GPUs sampled", keys=("gpus",), unit="GPUs", where="telemetry_figures.by_gpu",
           formula="distinct GPUs (NVML UUID) the samples came from; a GPU sampled by two processes is one series"),
    # ---- action-to-photon (a player session: client --player, scenario interactive; DESIGN §4) ---
    Figure(name="arm", label="arm", unit="—", where="interaction.A2PSummary",
           formula="the server configuration the player session ran against (scheduler, candidate)"),
    Figure(name="a2p_events", label="events", keys=("events",), unit="events", where="interaction.summarize",
           formula="input events the player sent in the session"),
    Figure(name="a2p_applied", label="applied", keys=("applied",), unit="events", where="interaction.applied_at",
           formula="events some chunk's header (or the session's ended) named as applied at its boundary"),
    Figure(name="a2p_late", label="late", keys=("late",), unit="events", where="interaction.summarize",
           formula="events the server receipted as arriving after the session's last boundary (no chunk left to apply them)"),
    Figure(name="a2p_delivery_p50", label="A2P delivery P50 ms", keys=("delivery_ms",), unit="ms",
           where="interaction.percentiles_ms",
           formula="per applied event, client clock: its chunk's media read − the event sent; median, " + NEAREST_RANK),
    Figure(name="a2p_delivery_p95", label="A2P delivery P95 ms", keys=("delivery_ms",), unit="ms",
           where="interaction.percentiles_ms", formula="the same, 95th percentile, nearest rank"),
    Figure(name="a2p_delivery_p99", label="A2P delivery P99 ms", keys=("delivery_ms",), unit="ms",
           where="interaction.percentiles_ms", formula="the same, 99th percentile, nearest rank (the maximum while n < 100)"),
    Figure(name="a2p_playout_p50", label="A2P playout P50 ms", keys=("playout_ms",), unit="ms",
           where="interaction.percentiles_ms",
           formula="per applied event, client clock: its chunk's first frame played (the client's playout model: "
                   "start after the prebuffer, then fps, stalls on underrun) − the event sent; median, nearest rank"),
    Figure(name="a2p_playout_p95", label="A2P playout P95 ms", keys=("playout_ms",), unit="ms",
           where="interaction.percentiles_ms", formula="the same, 95th percentile, nearest rank"),
    Figure(name="a2p_playout_p99", label="A2P playout P99 ms", keys=("playout_ms",), unit="ms",
           where="interaction.percentiles_ms", formula="the same, 99th percentile, nearest rank (the maximum while n < 100)"),
    Figure(name="a2p_next_share", label="next boundary %", keys=("next_share",), unit="%", where="interaction.next_boundary",
           formula="applied events applied at the first boundary at or after their arrival (server clock) ÷ applied events"),
    Figure(name="a2p_floor", label="A2P floor ms", keys=("floor_ms",), unit="ms", where="interaction.floor_ms",
           formula="what the cadence implies at delivery: boundary interval ÷ 2 (the mean wait of an event arriving "
                   "at a uniformly random moment) + pipeline"),
    Figure(name="a2p_delivery_intervals", label="A2P P50 / interval", keys=("delivery_ms", "interval_ms"), unit="intervals",
           where="interaction.in_intervals",
           formula="A2P delivery P50 ÷ the median boundary interval: the wait in chunks of cadence (the floor is "
                   "0.5 + pipeline ÷ interval)"),
    Figure(name="a2p_interval", label="boundary interval ms", keys=("interval_ms",), unit="ms", where="interaction.floor_ms",
           formula="median interval between consecutive chunk boundaries (server clock), nearest rank"),
    Figure(name="a2p_pipeline", label="pipeline ms", keys=("pipeline_ms",), unit="ms", where="interaction.floor_ms",
           formula="median over delivered chunks of media read (client) − boundary (server), nearest rank; one clock needed"),
    Figure(name="a2p_uplink", label="uplink ms", keys=("parts_ms",), unit="ms", where="interaction.event_parts",
           formula="mean over applied, delivered events of received (server) − sent (client); one clock only, else not measured"),
    Figure(name="a2p_wait", label="boundary wait ms", keys=("parts_ms",), unit="ms", where="interaction.event_parts",
           formula="mean of the applying chunk's boundary − the event received (server clock)"),
    Figure(name="a2p_generation", label="generation ms", keys=("parts_ms",), unit="ms", where="interaction.event_parts",
           formula="mean of latent_ready − boundary of the applying chunk: submit and the DiT"),
    Figure(name="a2p_decode", label="decode ms", keys=("parts_ms",), unit="ms", where="interaction.event_parts",
           formula="mean of cpu_ready − latent_ready of the applying chunk: the wait for the VAE, decode and D2H"),
    Figure(name="a2p_encode", label="encode ms", keys=("parts_ms",), unit="ms", where="interaction.event_parts",
           formula="mean of encoded − cpu_ready of the applying chunk: metadata IPC and the encoder"),
    Figure(name="a2p_transport", label="transport ms", keys=("parts_ms",), unit="ms", where="interaction.event_parts",
           formula="mean of media read (client) − encoded (server): window, socket, network; one clock only"),
    Figure(name="a2p_buffer", label="playout buffer ms", keys=("parts_ms",), unit="ms", where="interaction.event_parts",
           formula="mean of first frame played − media read (client clock): the client's playout buffer"),
    Figure(name="a2p_parts_sum", label="Σ parts ms", unit="ms", where="interaction.event_parts",
           formula="uplink + boundary wait + generation + decode + encode + transport + playout buffer = the mean "
                   "A2P at playout (means add up; medians do not)"),
    # ---- open-loop load (``load``; measure/goodput.py, measure/slices.py, measure/pareto.py) -------
    Figure(name="load_index", label="arrival", keys=("index",), unit="—", where="goodput.LoadRecord",
           formula="the session's place in the arrival order, from 0 (load.jsonl)"),
    Figure(name="load_outcome", label="arrival outcome", keys=("outcome",), unit="—", where="goodput.OUTCOMES",
           formula="served (ran to its end), refused (busy), queue_timeout (not admitted within --queue-timeout), "
                   "failed (anything else); every arrival gets one"),
    Figure(name="load_queue_wait", label="queue wait ms", keys=("queue_wait_ms", "queue_wait_p50_ms", "queue_wait_max_ms"),
           unit="ms", where="goodput.LoadRecord",
           formula="start sent → started read (client clock): the server's admission, its queue included"),
    Figure(name="load_ttfc", label="TTFC incl. queue ms", keys=("ttfc_ms", "ttfc_p50_ms", "ttfc_p99_ms"), unit="ms",
           where="goodput.LoadRecord",
           formula="start sent → chunk 0's media read (client clock), the admission queue included; run: nearest rank over served sessions"),
    Figure(name="load_interval_p50", label="session interval P50 ms", keys=("interval_p50_ms",), unit="ms",
           where="goodput.session_interval_p50",
           formula="the session's own cadence: nearest-rank median of its delivery intervals (media read, chunk 1 on)"),
    Figure(name="load_continuous", label="continuous play", keys=("continuous_ratio", "continuous_p50"), unit="%",
           where="goodput.LoadRecord",
           formula="play time ÷ (play time + stall time) of the client's paced player (measure.playout.playout) at the stream's fps"),
    Figure(name="load_meets_slo", label="meets SLO", keys=("meets_slo", "meeting_slo"), unit="—", where="goodput.meets",
           formula="served, TTFC incl. queue ≤ the SLO's ttfc and continuous play ≥ its play (--slo)"),
    Figure(name="load_offered", label="offered load", keys=("offered_per_min", "nominal_per_min"), unit="sessions/min",
           where="goodput.load_summary",
           formula="arrivals ÷ the run's span (first arrival → last session ended); nominal: the process's own rate"),
    Figure(name="load_served", label="served load", keys=("served_per_min",), unit="sessions/min",
           where="goodput.load_summary", formula="sessions served to their end ÷ the run's span"),
    Figure(name="load_refused", label="refused share", keys=("refused_share", "outcomes"), unit="%",
           where="goodput.load_summary", formula="arrivals the server answered busy ÷ arrivals"),
    Figure(name="load_goodput", label="goodput", keys=("goodput", "per_min", "low", "high"), unit="sessions/min",
           where="goodput.goodput",
           formula="sessions meeting the SLO ÷ the run's span; 95 % interval: Clopper–Pearson on the meeting share "
                   "× arrivals per minute (the open-loop rate, taken as exact)"),
    Figure(name="load_early_stop", label="early stop", keys=("early_stop", "stopped_early", "stop_reason"), unit="—",
           where="goodput.early_stop",
           formula="MLPerf LoadGen's binomial bound, both sides: 'share meeting the SLO ≥ P' decided met when "
                   "P(Binom(n, 1−P) ≤ misses) ≤ 0.01, missed when P(Binom(n, 1−P) ≥ misses) ≤ 0.01; arrivals stop then"),
    Figure(name="slice_p50", label="slice interval P50 ms", keys=("p50_ms", "low_ms", "high_ms"), unit="ms",
           where="slices.slices",
           formula="per slice (--slice sessions:N | seconds:T of arrivals), the nearest-rank P50 of its served sessions' "
                   "delivery intervals with a 95 % session-bootstrap interval"),
    Figure(name="slice_drifted", label="drifted", keys=("drifted",), unit="flag", where="slices.drifted",
           formula="the slice's P50 lies beyond the run's P50 interval and the slice's own interval does not reach back into it"),
    Figure(name="sweep_goodput_per_replica", label="goodput per replica", keys=("goodput_per_replica",),
           unit="sessions/min/replica", where="goodput.per_replica", formula="a sweep point's goodput ÷ its replicas"),
    Figure(name="sweep_goodput_per_gpu", label="goodput per GPU", keys=("goodput_per_gpu",), unit="sessions/min/GPU",
           where="goodput.per_gpu", formula="a sweep point's goodput ÷ (replicas × --gpus-per-replica), on a CUDA server; "
                                            "none on a CPU one or with --connect"),
    Figure(name="sweep_pareto", label="Pareto", keys=("pareto",), unit="flag", where="pareto.pareto_front",
           formula="no other sweep point has both a lower-or-equal cost (TTFC P50 or interval P99) and a higher-or-equal "
                   "goodput per GPU (per replica where the points hold no GPU), one strictly"),
)

#: The validity flags of ``summary.json`` (``summary.flags_and_validity``; ``stalled`` from ``summary.run_summary``),
#: one figure each: the console headline and report.md print every raised flag with this definition.
_FLAGS: tuple[tuple[str, str], ...] = (
    ("empty", "the run recorded no chunk event at all (invalid)"),
    ("no_measured_sessions", "no measured, non-cancelled session: every session was warm-up or cancelled (invalid)"),
    ("reference_boundary_absent", "the reference boundary (cpu_ready) was never recorded, so there is no headline (invalid)"),
    ("too_few_samples", "fewer than 100 steady intervals at the reference boundary: every P99 shown is the maximum "
                        "(marked *), and tail figures are not estimates"),
    ("one_session_ci_degenerate", "only one session gave steady intervals: a bootstrap over sessions has nothing to "
                                  "resample, so its 95 % CIs are a single point"),
    ("missing_boundaries", "some steady sample slots had a boundary unrecorded and were skipped (skipped (missing))"),
    ("has_cancelled", "some sessions were cancelled: counted, but they give no sample"),
    ("order_violations", "some chunk's boundaries are out of order or recorded twice: the table contradicts itself (invalid)"),
    ("no_session_starts", "no session start was recorded: TTFC and rollout figures are absent"),
    ("clocks_throttled", "--telemetry: NVML reported a clock-lowering reason (measure.telemetry_figures.THROTTLING: power cap, "
                         "thermal or hardware slowdown) on a GPU sample inside a steady interval; the reasons and their "
                         "sample counts are summary.json's telemetry.throttle_reasons"),
    ("stalled", "a stage owing the driver a reply made no progress for runtime.stall_report_s (plus "
                "runtime.compile_allowance_s on a compiled warm-up's first chunks); the stalls are listed in summary.json"),
)
_TABLE = _TABLE + tuple(Figure(name=f"flag_{n}", label=n, keys=(), unit="flag", where="summary.flags_and_validity",
                               formula=d) for n, d in _FLAGS)
FLAG_NAMES: tuple[str, ...] = tuple(n for n, _ in _FLAGS)

FIGURES: dict[str, Figure] = {f.name: f for f in _TABLE}


def define(name: str) -> Figure:
    try:
        return FIGURES[name]
    except KeyError:
        raise KeyError(f"figure {name!r} is not defined in harness.measure.figures") from None


def flag_figure(flag: str) -> str:
    """The figure that defines a summary flag (``too_few_samples`` → ``flag_too_few_samples``)."""
    return f"flag_{flag}"


def label(name: str, scheduler: str | None = None) -> str:
    f = define(name)
    return f.by_scheduler.get(scheduler, f.label) if scheduler else f.label


def labels_of(f: Figure) -> set[str]:
    return {f.label, *f.by_scheduler.values()}


def resolve(text: str) -> Figure:
    """The figure a printed label (any scheduler's spelling) belongs to."""
    hits = [f for f in _TABLE if text.strip() in labels_of(f)]
    if len(hits) != 1:
        raise KeyError(f"{text!r} is {'not a figure label' if not hits else 'ambiguous'}")
    return hits[0]


def summary_keys() -> set[str]:
    return {k for f in _TABLE for k in f.keys}


def table_md(names: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """A markdown definition table of ``names`` (default: every figure), one row each; a label
    that reads differently under a scheduler is given beside the default one."""
    rows = ["| figure | label | definition | unit | computed by |", "|---|---|---|---|---|"]
    for n in names if names is not None else FIGURES:
        f = define(n)
        other = "; ".join(f"{sch}: {lab}" for sch, lab in f.by_scheduler.items())
        rows.append(f"| `{f.name}` | {f.label}{f' ({other})' if other else ''} | {f.formula} | {f.unit} | `measure.{f.where}` |")
    return rows


def header(names: list[str] | tuple[str, ...], scheduler: str | None = None) -> list[str]:
    """A markdown table header whose columns are the figures' labels."""
    return ["| " + " | ".join(label(n, scheduler) for n in names) + " |",
            "|" + "|".join("---" if define(n).unit == "—" else "---:" for n in names) + "|"]


def console_table(names: list[str] | tuple[str, ...], rows: list[list[str]], scheduler: str | None = None,
                  indent: str = "  ") -> list[str]:
    """A console table whose header is the figures' labels: the first column left-aligned, the
    others right-aligned; a shorter row (``[boundary, "no steady samples"]``) runs on after its first cell."""
    heads = [label(n, scheduler) for n in names]
    full = [r for r in rows if len(r) == len(names)]
    widths = [max([len(h), 10] + [len(r[i]) for r in full]) for i, h in enumerate(heads)]

    def line(cells: list[str]) -> str:
        if len(cells) < len(names):
            return indent + "  ".join([cells[0].ljust(widths[0]), *cells[1:]])
        return indent + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(heads)] + [line(r) for r in rows]
