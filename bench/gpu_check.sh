#!/usr/bin/env bash
# The one command for a machine with a CUDA GPU (docs/performance.md, "On a GPU"): builds
# hostcallback in place with that machine's JAX, runs tests/gpu and the GPU benchmark, and ends
# with one summary line. Needs no network; finishes in about 6 minutes. Logs go to $OUT (or
# build/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${OUT:-build/gpu_check}
mkdir -p "$logs"
began=$(date +%s)
python3 - <<'PY' 2>&1 | tee "$logs/machine.log"
import jax
print("jax", jax.__version__, "devices", jax.devices())
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 \
  | tee -a "$logs/machine.log"

missing=$(python3 - <<'PY'
import importlib.util, shutil
print(" ".join([m for m in ("scikit_build_core", "nanobind", "numpy", "jax")
                if importlib.util.find_spec(m) is None]
               + ([] if shutil.which("cmake") or importlib.util.find_spec("cmake") else ["cmake"])))
PY
)
if [ -n "$missing" ]; then
  echo "gpu_check: this machine lacks $missing, which the in-place build needs (no network here)"
  exit 1
fi
if ! python3 -m pip install --no-build-isolation --no-deps . >"$logs/build.log" 2>&1; then
  tail -40 "$logs/build.log"
  echo "gpu_check: BUILD FAILED after $(($(date +%s) - began)) s (log: $logs/build.log)"
  exit 1
fi
echo "built in $(($(date +%s) - began)) s"

PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest --confcutdir=tests/gpu tests/gpu -q -ra \
  -p no:cacheprovider --timeout 120 2>&1 | tee "$logs/tests.log"
tests=${PIPESTATUS[0]}
tested=$(grep -Eo '[0-9]+ (passed|failed|skipped|error)[a-z]*' "$logs/tests.log" | tr '\n' ' ')

HOSTCALLBACK_GPU_FENCE=1 PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu_bench.py --json "$logs/bench.json" 2>&1 \
  | tee "$logs/bench.log"
bench=${PIPESTATUS[0]}
summary=$(python3 - "$logs/bench.json" <<'PY' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
s, big, step = r["small"], r["large"], r["step"]
print(f"small tap {s['native']['device_us_per_tap']:.2f} us ({s['native']['vs_debug']:.0f}x "
      f"below jax.debug.callback); 4 MiB taps {big['native']['gb_per_s']:.1f} GB/s "
      f"(copy {r['copy_gb_per_s']:.1f}); loss tap +{step['native, loss']['extra_percent']:.1f}% "
      f"of a {step['none_ms']:.2f} ms step, "
      f"+{step['native, loss, ready once handled']['extra_percent']:.1f}% ready once handled "
      f"(debug.callback +{step['debug, loss']['extra_percent']:.1f}%)")
PY
)
status=ok
[ "$tests" = 0 ] || status=FAILED
[ "$bench" = 0 ] || status=FAILED
echo "gpu_check: $status in $(($(date +%s) - began)) s: tests ${tested:-none} (rc $tests);" \
  "bench rc $bench: ${summary:-no figures}"
[ "$status" = ok ]
