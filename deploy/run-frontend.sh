#!/usr/bin/env bash
# The OpenAI-compatible frontend demo: install what is missing, build (release preset), start
# kvpoold with its embedded default (the synthetic "tiny" model, the standard runtime directory)
# and two kvpool-frontend processes on 127.0.0.1:8000 and :8001 (KVPOOL_FRONTEND_PORTS="A B" to
# change) sharing one API keys file with one demo key (kvpool-frontend-keys, in a temporary
# directory removed at the end), show them with curl (models, health, one completion through each
# frontend: the second finds the prompt in the daemon's prefix cache
# (usage.prompt_tokens_details.cached_tokens, in whole blocks), the same request without the key
# refused with 401, a streamed chat, a refused sampling parameter), drive both with
# kvpool-http-loadgen (time to first token, inter-token latency and cached prompt tokens from the
# HTTP side), print `kvpoolctl stats`, and stop everything cleanly (the frontends drain on
# SIGTERM).
#
#   deploy/run-frontend.sh                              # 4 streams at once, 32 requests
#   deploy/run-frontend.sh --concurrency 8 --requests 64 --max_tokens 128
#
# Arguments are passed to kvpool-http-loadgen (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake --preset release
cmake --build --preset release

bin=build/release
dir="${XDG_RUNTIME_DIR:+$XDG_RUNTIME_DIR/kvpool}"
dir="${dir:-/tmp/kvpool-$(id -u)}"
read -r -a ports <<< "${KVPOOL_FRONTEND_PORTS:-8000 8001}"

keys_dir=$(mktemp -d)
pids=()
stop() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do  # frontends first, the daemon last
    if kill -0 "${pids[i]}" 2>/dev/null; then
      kill -TERM "${pids[i]}"
      wait "${pids[i]}" || true
    fi
  done
  rm -rf "$keys_dir"
}
trap stop EXIT
# One demo user: the key is printed once by the tool; the file holds only its SHA-256.
keys="$keys_dir/keys.json"
KVPOOL_API_KEY=$("$bin/client/frontend/kvpool-frontend-keys" --keys_file="$keys" add demo)
export KVPOOL_API_KEY  # kvpool-http-loadgen sends it
auth=(-H "Authorization: Bearer $KVPOOL_API_KEY")

"$bin/daemon/kvpoold" &
pids+=($!)
for _ in $(seq 100); do  # up to 10 s for the sockets
  [[ -S "$dir/attach.sock" && -S "$dir/kvpoold.sock" ]] && break
  kill -0 "${pids[0]}" 2>/dev/null || { echo "run-frontend.sh: kvpoold failed to start" >&2; exit 1; }
  sleep 0.1
done

urls=()
for port in "${ports[@]}"; do
  "$bin/client/frontend/kvpool-frontend" --socket_dir="$dir" --port="$port" --keys_file="$keys" &
  pids+=($!)
  urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do  # up to 20 s each for the frontends to listen
  for _ in $(seq 200); do
    curl -sf "$url/health" >/dev/null && break
    sleep 0.1
  done
  curl -sf "$url/health" >/dev/null || { echo "run-frontend.sh: no frontend at $url" >&2; exit 1; }
done

show() { echo; echo "\$ $*"; "$@"; echo; }
prompt="You are a helpful assistant. Answer in one short sentence. What does a KV cache hold?"
show curl -s "${urls[0]}/v1/models" "${auth[@]}"
show curl -s "${urls[1]}/health"
for url in "${urls[@]}"; do  # the second frontend finds the prompt in the daemon's cache
  show curl -s "$url/v1/completions" "${auth[@]}" -H 'Content-Type: application/json' \
    -d "{\"model\": \"tiny\", \"prompt\": \"$prompt\", \"max_tokens\": 8}"
done
show curl -s "${urls[0]}/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"tiny\", \"prompt\": \"$prompt\", \"max_tokens\": 8}"
show curl -sN "${urls[1]}/v1/chat/completions" "${auth[@]}" -H 'Content-Type: application/json' \
  -d "{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"$prompt\"}], \"max_tokens\": 4, \"stream\": true, \"stream_options\": {\"include_usage\": true}}"
show curl -s "${urls[1]}/v1/completions" "${auth[@]}" -H 'Content-Type: application/json' \
  -d "{\"model\": \"tiny\", \"prompt\": \"$prompt\", \"max_tokens\": 8, \"temperature\": 0.8}"

echo "\$ kvpool-http-loadgen ${urls[*]} $*"
loadgen_args=()
for url in "${urls[@]}"; do loadgen_args+=(--url "$url"); done
status=0
"$bin/client/frontend/kvpool-http-loadgen" "${loadgen_args[@]}" "$@" || status=$?
echo
"$bin/client/kvpoolctl" --socket_dir="$dir" stats || true
trap - EXIT
stop
exit "$status"
