#!/usr/bin/env bash
# Runs kvpool's libFuzzer targets, each for SECONDS, as many at once as there are cores
# ($KVPOOL_FUZZ_JOBS sets another number), starting from its checked-in seeds
# (fuzz/corpus/<target>, which this never writes). New inputs go to
# OUT/corpus/<target>, crashes, leaks and timeouts to OUT/findings/<target>/. Exits non-zero when
# any target found something.
#
#   fuzz/run.sh [--build DIR] [--out DIR] SECONDS [TARGET...]     (default: every target)
#   fuzz/run.sh 25                                  # .ci/run: a short run of each
#   fuzz/run.sh 3600 service_fuzzer                 # a longer hunt
#
# The targets come from the ci-clang preset (cmake --preset ci-clang && cmake --build --preset
# ci-clang). Reproduce a finding with: build/ci-clang/fuzz/<target> OUT/findings/<target>/crash-*
set -euo pipefail
cd "$(dirname "$0")/.."

build=build/ci-clang/fuzz
out=build/fuzz-out
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --build) build="$2/fuzz"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "fuzz/run.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[[ $# -ge 1 ]] || { sed -n '2,12p' "$0" >&2; exit 2; }
seconds="$1"
shift
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(attach_fuzzer block_codec_fuzzer config_fuzzer safetensors_fuzzer service_fuzzer)

for t in "${targets[@]}"; do
  [[ -x "$build/$t" ]] || { echo "fuzz/run.sh: no $build/$t (build the ci-clang preset)" >&2; exit 2; }
done

# One target: its log in OUT/<target>.log, and OUT/<target>.failed when it found something.
run_one() {
  local t="$1"
  mkdir -p "$out/corpus/$t" "$out/findings/$t"
  rm -f "$out/$t.failed"
  local flags=()  # fuzz/<target>.dict, and the flags in fuzz/<target>.options (one per line)
  [[ -f "fuzz/$t.dict" ]] && flags+=("-dict=fuzz/$t.dict")
  [[ -f "fuzz/$t.options" ]] && mapfile -t -O "${#flags[@]}" flags < <(grep -v '^#' "fuzz/$t.options")
  # Each input must finish within -timeout seconds; memory beyond -rss_limit_mb is a finding.
  if ! "$build/$t" "${flags[@]}" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=3072 \
       -print_final_stats=1 -artifact_prefix="$out/findings/$t/" \
       "$out/corpus/$t" "fuzz/corpus/$t" 2> "$out/$t.log"; then
    touch "$out/$t.failed"
  fi
}

jobs_max="${KVPOOL_FUZZ_JOBS:-$(nproc)}"
mkdir -p "$out"
for t in "${targets[@]}"; do
  while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || true; done
  run_one "$t" &
done
wait

failed=()
for t in "${targets[@]}"; do
  echo "=== $t: ${seconds}s"
  if [[ -f "$out/$t.failed" ]]; then
    failed+=("$t")
    tail -n 60 "$out/$t.log" >&2
  fi
  grep -E '^(stat::number_of_executed_units|stat::new_units_added)' "$out/$t.log" || true
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz/run.sh: findings in ${failed[*]}: see $out/findings/" >&2
  exit 1
fi
echo "fuzz/run.sh: no findings"
