#!/usr/bin/env bash
# Installs, with apt, only the Debian 12 packages kvpool needs that are missing, then sets up ACL
# for the local redis-server it installs (deploy/setup-redis-acl.sh: a `kvpool` user whose
# password is in /etc/kvpool/redis-password, no anonymous access). Idempotent: a machine that
# has everything runs no apt command at all and changes nothing. Run as root (or with sudo
# available).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

packages=(
  # toolchain (clang-16 builds .ci/run's second tree, the ci-clang preset: lock annotations,
  # ASan + UBSan, libFuzzer, whose runtimes are in libclang-rt-16-dev; clang 14 cannot compile
  # std::source_location against libstdc++ 12)
  g++ cmake ninja-build ccache pkg-config git clang-16 libclang-rt-16-dev
  # the format check in .ci/run (tests/format/check_format.sh; .clang-format)
  clang-format
  # libraries (DESIGN.md "Stack")
  libabsl-dev libspdlog-dev libxxhash-dev nlohmann-json3-dev libsystemd-dev libopenblas-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  # HMAC-SHA256 for the deployment secret's MACs (tier/secret.h)
  libssl-dev
  # the vLLM KV-event publisher (daemon/edge/zmq_event_publisher.h, docs/events.md): ZeroMQ
  # sockets and msgpack payloads; python3-zmq and python3-msgpack for its test's consumer
  libzmq3-dev libmsgpack-cxx-dev python3-zmq python3-msgpack
  # the Redis tier (tier/): hiredis to talk to Redis; redis-server and redis-tools (redis-cli)
  # for its tests and benchmark, which start private servers themselves, and as the local Redis
  # a daemon may use (ACL set up below; `systemctl disable --now redis-server` if unwanted)
  libhiredis-dev redis-server redis-tools
  # kvpoold's /metrics endpoint (daemon/metrics): prometheus-cpp's Exposer and text format;
  # prometheus (with promtool) for its tests, which run a private Prometheus on loopback (the
  # package also enables its own prometheus.service on :9090; `systemctl disable --now
  # prometheus` if unwanted)
  prometheus-cpp-dev prometheus
  # tests and benchmarks (systemd: systemd-analyze and systemd-sysusers check deploy/)
  libgtest-dev libgmock-dev libbenchmark-dev systemd
  # the Python client (client/python: stubs from protoc + grpc_python_plugin above), the
  # OpenAI-compatible frontend (client/frontend), their tests and benchmarks; Debian's python3
  # (/usr/bin/python3), not whatever python3 comes first on PATH
  python3 python3-grpcio python3-protobuf python3-aiohttp python3-numpy python3-sentencepiece
  curl
  # the frontend's GET /metrics (client/frontend/kvpool_frontend/metrics.py): Prometheus' own
  # client library writes the text format and histograms (no hand-written exposition)
  python3-prometheus-client
  # property-based tests of the frontend's request parsing, API keys and limits
  # (tests/client/frontend/test_frontend_properties.py)
  python3-hypothesis
  # the Debian packages (docs/packaging.md; cmake --build --preset release --target package):
  # dpkg-shlibdeps (dpkg-dev) and file for CPack's library dependencies, help2man for the man
  # pages, lintian for deb_package_test
  dpkg-dev file help2man lintian
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

sudo=""
if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null; then
  sudo="sudo"
fi
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages present"
else
  if [[ $(id -u) -ne 0 && -z "$sudo" ]]; then
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Redis ACL for the local redis-server (the default user no longer answers anonymous clients).
# As root every run (it changes nothing when done); with sudo only the first time, so a machine
# that has everything does not ask for a sudo password.
if [[ $(id -u) -eq 0 ]]; then
  "$here/setup-redis-acl.sh"
elif [[ -e /etc/kvpool/redis-password ]]; then
  echo "install-deps: Redis ACL set up before; \`sudo deploy/setup-redis-acl.sh\` refreshes it"
elif [[ -n "$sudo" ]]; then
  sudo "$here/setup-redis-acl.sh"
else
  echo "install-deps: skipped the Redis ACL setup (needs root): run deploy/setup-redis-acl.sh as root"
fi
