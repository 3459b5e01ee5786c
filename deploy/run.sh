#!/usr/bin/env bash
# The README's main job: install what is missing, build (release preset, -Werror: the tree
# deploy/test.sh then tests), start kvpoold with its embedded default (CPU backend, 256 MiB pool,
# the synthetic "tiny" model, the standard runtime directory), drive it with kvpool-loadgen
# (several frontend processes that run no model: each conversation turn is a Prefill that reuses
# the previous turns through the prefix cache, then one Decode per reply token, gathered across
# the frontends into shared model steps), show the daemon's stats, and stop it cleanly.
#
#   deploy/run.sh                     # the generated multi-tenant conversation workload
#   deploy/run.sh --trace=../shared/traces/mooncake/conversation_trace.jsonl --max_requests=200
#   deploy/run.sh --mode=kv           # frontends write KV themselves; reused KV is verified
#
# Arguments are passed to kvpool-loadgen (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake --preset release
cmake --build --preset release

bin=build/release
dir="${XDG_RUNTIME_DIR:+$XDG_RUNTIME_DIR/kvpool}"
dir="${dir:-/tmp/kvpool-$(id -u)}"

"$bin/daemon/kvpoold" &
daemon=$!
stop() {
  if kill -0 "$daemon" 2>/dev/null; then
    kill -TERM "$daemon"
    wait "$daemon" || true
  fi
}
trap stop EXIT
for _ in $(seq 100); do  # up to 10 s for the sockets
  [[ -S "$dir/attach.sock" ]] && break
  kill -0 "$daemon" 2>/dev/null || { echo "run.sh: kvpoold failed to start" >&2; exit 1; }
  sleep 0.1
done

status=0
"$bin/client/loadgen/kvpool-loadgen" "$@" || status=$?
echo
"$bin/client/kvpoolctl" stats || true
trap - EXIT
stop
exit "$status"
