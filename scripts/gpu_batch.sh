#!/usr/bin/env bash
# GPU measurements for docs/results: engine benchmarks and full-size serves on one, two or four GPUs.
# Usage: scripts/gpu_batch.sh OUT_DIR [STEP…]
#   steps: probe bench1 bench1c bench2 bench2c bench704 bench704c mem served servee servee-shared compare abeng
#          report gate bench4 serve4d serve4e report4 gputests h4 dit det colocate replay mps-on mps-off
#          fa3tests arms replayfa3 benchcand omni interactive vaelayout condition
# Environment: MODE (serve/bench mode), TAG (suffix of a repeated serve), SESSIONS, VARIANTS (dit),
#   GATE_A / GATE_B / GATE_EXACT (gate between two run directories of this scratch folder),
#   CAND / ROUNDS / LAYERS (compare: the candidate, rounds, DiT depth), LAUNCHES / PAIRS / CHUNKS (abeng),
#   EXTRA (more serve options for compare, e.g. "--dit-gpus 0 --vae-gpus 1"),
#   RES (480x832 or 704x1280: the 4-GPU steps bench4 serve4d serve4e report4 of the production topology),
#   SCRATCH (where run directories go; default /tmp/harness-gpu), STEP_TIMEOUT (seconds per step, 420),
#   REPLAY_SP / REPLAY_KV (replay: SP degrees and K lengths), REPLAY_BACKENDS (replayfa3),
#   TEL_HZ / TEL_ROUNDS (step telemetry: the NVML rate, default 10, and off/on pairs, default 2; CAND adds candidates, EXTRA serve options),
#   ARMS (arms: space-separated NAME=ID[+ID…], each A/B'd against one shared baseline in one engine;
#   with ROUNDS / CHUNKS / LAUNCHES — ≥ 2 fresh processes give every arm a verdict), CAND (benchcand: '+'-joined candidates; DiT only, with a kernel breakdown).
# One-GPU steps can run side by side on a multi-GPU host, each with its own GPU and scratch folder:
#   CUDA_VISIBLE_DEVICES=1 SCRATCH=/tmp/g1 scripts/gpu_batch.sh OUT/g1 STEP…
# Run directories go to a scratch folder (media and saved outputs are large); the small files
# (summaries, events, manifests, logs, bench JSON) are packed into OUT_DIR/results.tgz.
set -uo pipefail
OUT=${1:?usage: gpu_batch.sh OUT_DIR [STEP...]}; shift
STEPS=${*:-bench1 bench2 served servee}
M=${MODE:-eager}; TAG=${TAG:-}  # serve steps: execution mode, and a suffix for repeated runs
RES=${RES:-480x832}
SCRATCH=${SCRATCH:-/tmp/harness-gpu}
mkdir -p "$OUT" "$SCRATCH"
OUT=$(CDPATH= cd -- "$OUT" && pwd) || exit 1  # the results are packed from inside SCRATCH
export PYTHONUNBUFFERED=1
H="python3 -m harness"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$SCRATCH/gpus.csv" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" > "$SCRATCH/versions.txt" 2>&1
step() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS; timeout "${STEP_TIMEOUT:-420}" "$@" > "$SCRATCH/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS-t0))s" | tee -a "$SCRATCH/steps.txt"; tail -n 12 "$SCRATCH/$name.log"; }
need() { for v in "$@"; do [ -n "${!v:-}" ] || { echo "step $s needs $v: skipped" | tee -a "$SCRATCH/steps.txt"; return 1; }; done; }
telemetry_pairs() {
  local cand=${CAND:+$(sed 's/+\(H[0-9]\)/\n\1/g' <<< "$CAND" | sed 's/^/--candidate /')} tag=${CAND:+-${CAND//[:+]/_}} r dirs=()
  for r in $(seq 1 "${TEL_ROUNDS:-2}"); do
    for arm in off on; do
      local d="$SCRATCH/telemetry-$RES-$M$tag-$arm-$r"; dirs+=("$d")
      step "telemetry-$RES-$M$tag-$arm-$r" $H serve --preset lingbot-$RES --device cuda --mode "$M" --sessions "${SESSIONS:-4}" \
        $cand ${EXTRA:-} $([ $arm = on ] && echo --telemetry "${TEL_HZ:-10}") --out "$d" --no-progress
    done
  done
  python3 - "${dirs[@]}" <<'PY' | tee "$SCRATCH/telemetry-$RES-$M$tag.txt"
import json, sys
for d in sys.argv[1:]:
    try:
        s = json.load(open(f"{d}/summary.json"))
    except OSError:
        print(d, "no summary"); continue
    t, h = s.get("telemetry") or {}, s["headline"]
    print(d.rsplit("/", 1)[-1], "interval P50 ms", h.get("p50_ms"), "J/frame", t.get("energy_per_frame_j"),
          "W", t.get("power_mean_w"), "flags", s.get("flags"))
PY
}

omni_pair() {
  local srv="$SCRATCH/omni-server-$RES-$M" cli="$SCRATCH/omni-client-$RES-$M" log="$SCRATCH/omni-server-$RES-$M.log" url=""
  local w=${RES#*x} h=${RES%x*}
  $H serve --preset lingbot-$RES --device cuda --mode "$M" --listen 127.0.0.1:0 --api vllm-omni --sessions "${SESSIONS:-4}" \
      --out "$srv" --no-progress > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 "${STEP_TIMEOUT:-420}"); do
    url=$(grep -o 'ws://[^ ]*' "$log" | head -n 1); [ -n "$url" ] && break
    kill -0 "$pid" 2>/dev/null || break; sleep 1
  done
  if [ -z "$url" ]; then echo "rc=1 omni: the server never listened" | tee -a "$SCRATCH/steps.txt"; tail -n 20 "$log"; kill "$pid" 2>/dev/null; return; fi
  step omni-client-$RES-$M $H client --api vllm-omni --connect "$url" --sessions "${SESSIONS:-4}" --chunks "${CHUNKS:-10}" \
      --width "$w" --height "$h" --prompt "a road through a forest" --out "$cli"
  wait "$pid"; echo "rc=$? omni-server-$RES-$M" | tee -a "$SCRATCH/steps.txt"; tail -n 12 "$log"
}
for s in $STEPS; do
  case $s in
    probe)    step probe python3 -c "import torch, torch._inductor.config as c; print(torch.__version__, {k: getattr(c, k, 'absent') for k in ('emulate_precision_casts', 'keep_addmm_fused_for_half_dtypes', 'deterministic', 'pattern_matcher')})" ;;
    bench1c)  step bench-480-sp1-compiled $H bench-engine --preset lingbot-480x832 --device cuda --mode "${MODE:-compiled}" --json "$SCRATCH/bench-480-sp1-compiled.json" ;;
    bench704c) step bench-704-sp1-compiled $H bench-engine --preset lingbot-704x1280 --device cuda --mode "${MODE:-compiled}" --json "$SCRATCH/bench-704-sp1-compiled.json" ;;
    mem)      step memory-50-sessions $H bench-engine --preset lingbot-480x832 --device cuda --mode "${MODE:-compiled}" --set model.num_layers=2 --sessions 50 --chunks 7 --json "$SCRATCH/memory-50-sessions.json" ;;
    bench1)   step bench-480-sp1 $H bench-engine --preset lingbot-480x832 --device cuda --json "$SCRATCH/bench-480-sp1.json" ;;
    bench2)   step bench-480-sp2 $H bench-engine --preset lingbot-480x832 --device cuda --sp 2 --vae-ranks 2 --json "$SCRATCH/bench-480-sp2.json" ;;
    bench704) step bench-704-sp1 $H bench-engine --preset lingbot-704x1280 --device cuda --json "$SCRATCH/bench-704-sp1.json" ;;
    served)   step serve-480-d-$M$TAG $H serve --preset lingbot-480x832 --device cuda --mode $M --sessions "${SESSIONS:-2}" --scheduler case-d --out "$SCRATCH/serve-480-d-$M$TAG" --no-progress ;;
    servee)   step serve-480-e-separate-$M$TAG $H serve --preset lingbot-480x832 --device cuda --mode $M --sessions "${SESSIONS:-2}" --scheduler case-e --dit-gpus 0 --vae-gpus 1 --out "$SCRATCH/serve-480-e-separate-$M$TAG" --no-progress ;;
    servee-shared) step serve-480-e-shared-$M$TAG $H serve --preset lingbot-480x832 --device cuda --mode $M --sessions "${SESSIONS:-2}" --scheduler case-e --out "$SCRATCH/serve-480-e-shared-$M$TAG" --no-progress ;;
    bench2c)  step bench-480-sp2-compiled $H bench-engine --preset lingbot-480x832 --device cuda --sp 2 --vae-ranks 2 --mode "${MODE:-compiled}" --json "$SCRATCH/bench-480-sp2-compiled.json" ;;
    compare)  need CAND && step compare-$CAND$TAG $H compare --preset lingbot-480x832 --device cuda --mode $M --candidate "$CAND" --rounds "${ROUNDS:-2}" --sessions "${SESSIONS:-3}" --set model.num_layers="${LAYERS:-40}" ${EXTRA:-} --out "$SCRATCH/compare-$CAND$TAG" --no-progress ;;
    bench4)   step bench-$RES-sp4-compiled $H bench-engine --preset lingbot-$RES --device cuda --sp 4 --vae-ranks 4 --mode compiled --json "$SCRATCH/bench-$RES-sp4-compiled.json" ;;
    serve4d)  step serve-$RES-sp4-d-compiled $H serve --preset lingbot-$RES --device cuda --mode compiled --sp 4 --vae-ranks 4 --sessions "${SESSIONS:-6}" --scheduler case-d --out "$SCRATCH/serve-$RES-sp4-d-compiled" --no-progress ;;
    serve4e)  step serve-$RES-sp4-e-compiled $H serve --preset lingbot-$RES --device cuda --mode compiled --sp 4 --vae-ranks 4 --sessions "${SESSIONS:-6}" --scheduler case-e --out "$SCRATCH/serve-$RES-sp4-e-compiled" --no-progress ;;
    report4)  step report-$RES-sp4 $H report "$SCRATCH/serve-$RES-sp4-d-compiled" "$SCRATCH/serve-$RES-sp4-e-compiled" --bench "$SCRATCH/bench-$RES-sp4-compiled.json" --out "$SCRATCH/report-$RES-sp4" ;;
    abeng)    need CAND && step ab-engine-$CAND $H ab-engine --preset lingbot-480x832 --device cuda --sp 1 --mode "${MODE:-compiled}" --candidate "$CAND" --launches "${LAUNCHES:-3}" --pairs "${PAIRS:-4}" --chunks "${CHUNKS:-7}" --json "$SCRATCH/ab-engine-$CAND.json" ;;
    report)   step report $H report $(ls -d "$SCRATCH"/serve-*/ 2>/dev/null) --out "$SCRATCH/report" ;;
    gate)     need GATE_A GATE_B && step "gate-$GATE_A-vs-$GATE_B" $H gate "$SCRATCH/$GATE_A" "$SCRATCH/$GATE_B" ${GATE_EXACT:+--exact} --json "$SCRATCH/gate-$GATE_A-vs-$GATE_B.json" ;;
    gputests) step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/candidates/test_h4a_fused_output.py tests/candidates/test_h4b_pinned_d2h.py tests/hooks/test_hooks_cuda.py tests/engine/test_dit_cuda_nosync.py ;;
    condition) step condition python3 -m harness gpu-checks condition --json "$SCRATCH/condition.json" ;;
    vaelayout) step vae-layout python3 -m harness gpu-checks vae-layout --json "$SCRATCH/vae-layout.json" ;;
    h4)       step h4-output python3 -m harness gpu-checks output --json "$SCRATCH/h4-output.json" ;;
    dit)      step dit-compiled python3 -m harness gpu-checks dit --variants "${VARIANTS:-engine}" --json "$SCRATCH/dit-compiled.json" ;;
    det)      step determinism python3 -m harness gpu-checks determinism --json "$SCRATCH/determinism.json" ;;
    colocate) step colocate-${MODE:-compiled} python3 -m harness gpu-checks colocate --mode "${MODE:-compiled}" --json "$SCRATCH/colocate-${MODE:-compiled}.json" ;;
    # MPS lets the DiT's and the VAE's processes run kernels at once instead of time-slicing; the
    # daemon lives under /tmp (the path serve's manifest checks) and is stopped by mps-off.
    mps-on)   export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
              mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
              step mps-on nvidia-cuda-mps-control -d ;;
    mps-off)  echo quit | nvidia-cuda-mps-control; echo "mps-off rc=$?" | tee -a "$SCRATCH/steps.txt" ;;
    replay)   step replay-480 python3 -m harness replay --synthetic lingbot-480x832 --device cuda --sp "${REPLAY_SP:-1,2}" --kv "${REPLAY_KV:-4680,14040,28080}" --repeats 10 --warmup 2 --out "$SCRATCH/replay-480" ;;
    fa3tests) step fa3-tests python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_fa3_cuda.py ;;
    arms)     need ARMS && step ab-arms-$RES $H ab-arms --preset lingbot-$RES --device cuda --mode "${MODE:-compiled}" \
                $(for a in $ARMS; do printf -- '--arm %s ' "$a"; done) --rounds "${ROUNDS:-4}" --launches "${LAUNCHES:-1}" --chunks "${CHUNKS:-7}" --kernels --json "$SCRATCH/ab-arms-$RES.json" ;;
    replayfa3) step replay-fa3 python3 -m harness replay --synthetic lingbot-$RES --device cuda --sp 1 --kv "${REPLAY_KV:-28080}" \
                --backends "${REPLAY_BACKENDS:-sdpa-cudnn,fa3,fa3-fp8,fa3-fp8-smooth,emu-fp8-v,emu-fp8-qk,emu-fp8-p,emu-fp8-qkvp,emu-fp8-v-smooth,emu-fp8-qkvp-smooth}" \
                --repeats 10 --warmup 2 --out "$SCRATCH/replay-fa3" ;;
    benchcand) need CAND && step bench-$RES-sp1-compiled-${CAND//[:+]/_} $H bench-engine --preset lingbot-$RES --device cuda --mode "${MODE:-compiled}" \
                $(sed 's/+\(H[0-9]\)/\n\1/g' <<< "$CAND" | sed 's/^/--candidate /') --no-vae --kernels --json "$SCRATCH/bench-$RES-sp1-compiled-${CAND//[:+]/_}.json" ;;
    # production's realtime API both ways: serve --listen --api vllm-omni measured by client --api vllm-omni;
    # the two run directories' steady interval P50 at delivered, side by side (SESSIONS: the server's, warm-up included)
    omni)     omni_pair ;;
    # action-to-photon over Case D, Case E and H5a (one serve --listen each); PLAYER: the trace
    interactive) step interactive-$RES-$M $H scenario interactive --preset lingbot-$RES --device cuda --mode "$M" \
                --player "${PLAYER:-random:0}" --chunks "${CHUNKS:-10}" --out "$SCRATCH/interactive-$RES-$M" ;;
    # NVML telemetry (J/frame, mean power, throttling) on the 480x832 preset, and its overhead: serves with
    # telemetry off and on alternated (off on off on …), then their steady interval P50 and J/frame side by side
    telemetry) telemetry_pairs ;;
    *) echo "unknown step $s" ;;
  esac
done
(cd "$SCRATCH" && tar czf "$OUT/results.tgz" --exclude='*.npy' --exclude='*.mkv' --exclude='*.mp4' --exclude='*.part' --exclude='dispatch*.jsonl' .)
ls -la "$OUT"
