#!/usr/bin/env bash
# The Debian packages (cmake/Packaging.cmake, docs/packaging.md), built from this build tree and
# checked the way an operator would meet them, without touching the running system:
#   1. cpack writes kvpool, kvpool-dev (and, with the Python client, python3-kvpool and
#      kvpool-frontend), each at the project's version, into a scratch directory;
#   2. lintian reports no error and no warning on any of them;
#   3. dpkg --root installs them into a scratch root, running the maintainer scripts there
#      (DPKG_ROOT): sysusers makes the kvpool user, tmpfiles its state and cache directories,
#      /etc/kvpool/kvpoold.textproto is a conffile;
#   4. systemd-analyze verify accepts the installed unit inside that root (ExecStart resolved to
#      the installed kvpoold, Documentation=man:kvpoold(8) to the installed man page);
#   5. the installed kvpoold and kvpoolctl print the package's version; the installed kvpoold
#      starts with the installed configuration and answers the installed kvpoolctl, a client
#      built with CMake from nothing but the installed kvpool-dev (deb_consumer/), and the
#      installed Python client (both see the package's version at attach); with the CUDA
#      backend packaged, --backend=cuda loads it from <root>/usr/lib/kvpool;
#   6. dpkg --purge removes the files, the conffile and the state and cache directories, and
#      keeps the kvpool user.
#
#   deb_package_test.sh BUILD_DIR VERSION WITH_PYTHON(ON|OFF) WITH_CUDA(ON|OFF)
#
# Skips (exit 77) when lintian, help2man, dpkg-deb, systemd-analyze or systemd-sysusers is
# missing (deploy/install-deps.sh installs them).
set -euo pipefail

build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
version="$2"
with_python="$3"
with_cuda="$4"
fail() { echo "FAIL: $*" >&2; exit 1; }

for tool in lintian help2man dpkg-deb systemd-analyze systemd-sysusers; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIPPED: $tool is not installed (deploy/install-deps.sh installs it)"
    exit 77
  fi
done

tmp=$(mktemp -d)
daemon=""
cleanup() {
  if [[ -n "$daemon" ]] && kill -0 "$daemon" 2>/dev/null; then
    kill -TERM "$daemon"
    wait "$daemon" || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
SECONDS=0
phase() { echo "--- $1 (at ${SECONDS} s)"; }

# 1. Build the packages.
phase "cpack"
# gzip rather than the packages' xz: the same contents, 10 s less on two cores.
(cd "$tmp" && cpack --config "$build/CPackConfig.cmake" -B "$tmp/deb" \
   -D CPACK_DEBIAN_COMPRESSION_TYPE=gzip >"$tmp/cpack.log" 2>&1) ||
  { cat "$tmp/cpack.log" >&2; fail "cpack"; }
arch=$(dpkg --print-architecture)
expected=("kvpool_${version}_${arch}.deb" "kvpool-dev_${version}_${arch}.deb")
if [[ "$with_python" == ON ]]; then
  expected+=("python3-kvpool_${version}_all.deb" "kvpool-frontend_${version}_all.deb")
fi
debs=()
for name in "${expected[@]}"; do
  [[ -f "$tmp/deb/$name" ]] || fail "cpack wrote no $name (has: $(cd "$tmp/deb" && echo *.deb))"
  [[ "$(dpkg-deb -f "$tmp/deb/$name" Version)" == "$version" ]] || fail "$name: wrong Version"
  debs+=("$tmp/deb/$name")
done
[[ $(ls "$tmp/deb"/*.deb | wc -l) -eq ${#expected[@]} ]] || fail "unexpected packages"
main="$tmp/deb/kvpool_${version}_${arch}.deb"
echo "packages: ${expected[*]}"

# 2. lintian: no error, no warning (information-level tags are listed in docs/packaging.md).
phase "lintian"
lintian --allow-root --fail-on error,warning "${debs[@]}" || fail "lintian (above)"

# 3. Install into a scratch root; the maintainer scripts run against it, not against /.
phase "dpkg --root"
root="$tmp/root"
mkdir -p "$root/var/lib/dpkg/updates" "$root/var/lib/dpkg/info"
touch "$root/var/lib/dpkg/status"
dpkg --root="$root" --force-not-root --force-script-chrootless --force-depends \
  --log="$tmp/dpkg.log" --install "${debs[@]}" >"$tmp/dpkg.out" 2>&1 ||
  { cat "$tmp/dpkg.out" >&2; fail "dpkg --install"; }
for pkg in kvpool kvpool-dev; do
  [[ "$(dpkg-query --root="$root" -W -f='${Status}' "$pkg")" == "install ok installed" ]] ||
    fail "$pkg is not installed and configured in the scratch root"
done
conffile=/etc/kvpool/kvpoold.textproto
dpkg-query --root="$root" -W -f='${Conffiles}\n' kvpool | grep -q "^ $conffile " ||
  fail "$conffile is not a conffile"
uid=$(awk -F: '$1 == "kvpool" { print $3 }' "$root/etc/passwd")
[[ -n "$uid" ]] || fail "postinst (systemd-sysusers) made no kvpool user in the scratch root"
for dir in /var/lib/kvpool /var/cache/kvpool; do
  [[ "$(stat -c '%u %a' "$root$dir")" == "$uid 700" ]] ||
    fail "postinst (systemd-tmpfiles) made no $dir owned by kvpool, mode 0700"
done
for path in /usr/bin/kvpoold /usr/bin/kvpoolctl /usr/lib/systemd/system/kvpoold.service \
            /usr/lib/sysusers.d/kvpool.conf /usr/lib/tmpfiles.d/kvpool.conf \
            /usr/share/man/man8/kvpoold.8.gz /usr/share/doc/kvpool/copyright \
            /usr/share/doc/kvpool/changelog.gz /usr/include/kvpool/client/client.h; do
  [[ -e "$root$path" ]] || fail "nothing installed at $path"
done
echo "installed: user kvpool ($uid), $conffile a conffile"

# 4. The installed unit, verified inside the root: ExecStart must resolve to the installed binary
# (systemd's own units copied in for the targets it names; man(1) sees the installed pages).
phase "systemd-analyze verify"
unit=/usr/lib/systemd/system/kvpoold.service
grep -q "^ExecStart=/usr/bin/kvpoold --config=$conffile " "$root$unit" ||
  fail "the installed unit does not run /usr/bin/kvpoold with $conffile"
cp -an /usr/lib/systemd/system/. "$root/usr/lib/systemd/system/"
if ! verify=$(cd "$tmp" && MANPATH="$root/usr/share/man" \
                systemd-analyze verify --root="$root" "$unit" 2>&1) || [[ -n "$verify" ]]; then
  fail "systemd-analyze verify: ${verify:-non-zero exit}"
fi
echo "systemd-analyze verify: clean"

# 5. The installed programs.
phase "installed programs"
for program in kvpoold kvpoolctl; do
  got=$("$root/usr/bin/$program" --version)
  [[ "$got" == "$program $version" ]] || fail "$program --version printed '$got'"
done
echo "--version: $version"
run="$tmp/run"
"$root/usr/bin/kvpoold" --config="$root$conffile" --listen="$run" 2>"$tmp/kvpoold.log" &
daemon=$!
for _ in $(seq 100); do  # up to 10 s for the sockets
  [[ -S "$run/attach.sock" && -S "$run/kvpoold.sock" ]] && break
  kill -0 "$daemon" 2>/dev/null || { cat "$tmp/kvpoold.log" >&2; fail "installed kvpoold exited"; }
  sleep 0.1
done
"$root/usr/bin/kvpoolctl" --socket_dir="$run" check >"$tmp/check.out" 2>&1 ||
  { cat "$tmp/check.out" "$tmp/kvpoold.log" >&2; fail "installed kvpoolctl check"; }
echo "installed kvpoold with $conffile: kvpoolctl check passed"
# kvpool-dev: a client built from nothing but the installed package attaches.
config=$(ls "$root"/usr/lib/*/cmake/kvpool/kvpoolConfig.cmake)
consumer="$tmp/consumer"
{ cmake -S "$here/deb_consumer" -B "$consumer" -G Ninja -Dkvpool_DIR="$(dirname "$config")" &&
    cmake --build "$consumer"; } >"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log" >&2; fail "building a client against the installed kvpool-dev"; }
got=$("$consumer/deb_consumer" "$run") || fail "the kvpool-dev client did not attach"
[[ "$(head -n 1 <<<"$got")" == "kvpoold $version" ]] || fail "kvpool-dev client saw: $got"
echo "installed kvpool-dev: a client built from it attached ($(tail -n 1 <<<"$got"))"
if [[ "$with_python" == ON ]]; then
  if ! PYTHONPATH="$root/usr/lib/python3/dist-packages:$root/usr/share/kvpool-frontend" \
       PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 - "$run" "$version" <<'EOF'; then
import sys
import kvpool
import kvpool_frontend.server  # the frontend's modules import from their installed place
assert "/root/usr/lib/python3/dist-packages/kvpool/" in kvpool.__file__, kvpool.__file__
with kvpool.Client.connect(sys.argv[1]) as c:
    # The daemon reports the project's version at attach (kvpool/util/version.h).
    assert c.daemon_version == "kvpoold " + sys.argv[2], c.daemon_version
    stats = c.get_stats()
    assert stats.pools, "no pools in GetStats"
print("installed python3-kvpool: attached to", c.daemon_version, "and GetStats answered")
EOF
    fail "installed Python client"
  fi
fi
kill -TERM "$daemon"
wait "$daemon" || fail "installed kvpoold did not exit cleanly on SIGTERM"
daemon=""

# The CUDA backend, when packaged, is the one kvpoold loads (from <root>/usr/lib/kvpool, not the
# build tree's): without a GPU, --backend=cuda fails naming that file; with one, the running
# daemon has that file mapped.
plugin="$root/usr/lib/kvpool/libkvpool_cuda.so"
if [[ "$with_cuda" == ON ]]; then
  [[ -f "$plugin" ]] || fail "the CUDA backend was built but is not in the package"
  run="$tmp/run-cuda"
  "$root/usr/bin/kvpoold" --backend=cuda --listen="$run" --config="$root$conffile" \
    >"$tmp/cuda.log" 2>&1 &
  daemon=$!
  for _ in $(seq 200); do  # up to 20 s: a GPU's context takes a while
    [[ -S "$run/attach.sock" ]] && break
    kill -0 "$daemon" 2>/dev/null || break
    sleep 0.1
  done
  if [[ -S "$run/attach.sock" ]]; then
    grep -q "$(realpath "$plugin")" "/proc/$daemon/maps" ||
      fail "kvpoold --backend=cuda runs without the packaged backend mapped"
    kill -TERM "$daemon"
    wait "$daemon" || fail "kvpoold --backend=cuda did not exit cleanly on SIGTERM"
    echo "CUDA backend: a GPU, kvpoold runs on the packaged backend"
  else
    status=0
    wait "$daemon" || status=$?
    grep -q "CUDA backend $root/usr/bin/../lib/kvpool/libkvpool_cuda.so loaded" "$tmp/cuda.log" ||
      { cat "$tmp/cuda.log" >&2; fail "kvpoold --backend=cuda did not load the packaged backend"; }
    echo "CUDA backend: loaded from the package, no GPU here (kvpoold exit $status)"
  fi
  daemon=""
else
  [[ ! -e "$plugin" ]] || fail "a CUDA backend is packaged that this build did not make"
  echo "CUDA backend: not built, not packaged"
fi
# 6. Purge: the programs, the conffile, the state and cache directories go; the user stays.
phase "dpkg --purge"
packages=()
for name in "${expected[@]}"; do packages+=("${name%%_*}"); done
dpkg --root="$root" --force-not-root --force-script-chrootless --force-depends \
  --log="$tmp/dpkg.log" --purge "${packages[@]}" >"$tmp/purge.out" 2>&1 ||
  { cat "$tmp/purge.out" >&2; fail "dpkg --purge"; }
for path in /usr/bin/kvpoold "$conffile" /var/lib/kvpool /var/cache/kvpool \
            /usr/lib/systemd/system/kvpoold.service; do
  [[ ! -e "$root$path" ]] || fail "$path is still there after the purge"
done
grep -q '^kvpool:' "$root/etc/passwd" || fail "the purge removed the kvpool user"
echo "purged: files, conffile, state and cache gone; user kvpool kept"
echo "PASS (${SECONDS} s)"
