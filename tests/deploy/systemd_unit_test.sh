#!/usr/bin/env bash
# The systemd deployment (deploy/kvpoold.service, deploy/kvpoold.sysusers) checked with systemd's
# own tools, offline: `systemd-analyze verify` accepts the unit without a single warning (with
# ExecStart pointing at the kvpoold just built, so it can check the binary); its
# `systemd-analyze security` exposure stays at or below kMaxExposure; sysusers creates the user
# and group the unit runs as; and the modes let members of that group reach the sockets
# (RuntimeDirectoryMode group r-x, the sample config's socket_mode group rw, nothing for others);
# and the TCP drop-in (deploy/kvpoold-network.conf) verifies and stays within its own bound.
#
#   systemd_unit_test.sh KVPOOLD_BINARY DEPLOY_DIR
#
# Skips (exit 77) only when systemd-analyze is not installed (deploy/install-deps.sh installs it).
set -euo pipefail

# Exposure x10, as `systemd-analyze security --threshold` counts it. Measured: 0.6 (systemd 252,
# Debian 12); a dropped sandboxing option pushes it over.
readonly kMaxExposure=7

binary="$1"
deploy=$(cd "$2" && pwd)  # absolute: systemd-sysusers --root reads relative paths inside the root
fail() { echo "FAIL: $*" >&2; exit 1; }

if ! command -v systemd-analyze >/dev/null; then
  echo "SKIPPED: systemd-analyze is not installed (Debian: apt-get install systemd)"
  exit 77
fi
[[ -x "$binary" ]] || fail "no kvpoold binary at $binary"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unit="$tmp/kvpoold.service"
sed "s#/usr/local/bin/kvpoold#$binary#" "$deploy/kvpoold.service" > "$unit"
grep -q "^ExecStart=$binary " "$unit" || fail "ExecStart does not run /usr/local/bin/kvpoold"

# 1. verify: no output at all (unknown keys and bad values are warnings, not errors). --man=no:
# Documentation=man:kvpoold(8) exists once the package is installed (deb_package_test.sh
# verifies the installed unit with its man page), not in the source tree.
if ! verify=$(cd "$tmp" && systemd-analyze verify --man=no "$unit" 2>&1) || [[ -n "$verify" ]]; then
  fail "systemd-analyze verify: ${verify:-non-zero exit}"
fi
echo "systemd-analyze verify: clean"

# 2. security: the exposure score, bounded.
status=0
security=$(systemd-analyze security --offline=yes --threshold="$kMaxExposure" "$unit" 2>&1) ||
  status=$?
echo "$security" | grep -E '^✗' || true
score=$(echo "$security" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
[[ -n "$score" ]] || fail "no exposure level in: $security"
echo "exposure: $score (at most 0.$kMaxExposure)"
[[ $status -eq 0 ]] || fail "exposure $score is above 0.$kMaxExposure"

# 3. Settings the exposure score does not weigh.
setting() { sed -n "s/^$1=//p" "$unit" | tail -n 1; }
[[ "$(setting Type)" == notify ]] || fail "Type is not notify"
[[ "$(setting Restart)" == on-failure ]] || fail "Restart is not on-failure"
[[ -n "$(setting LimitNOFILE)" ]] || fail "no LimitNOFILE"
[[ "$(setting RuntimeDirectory)" == kvpool ]] || fail "RuntimeDirectory is not kvpool"
grep -q -- '--listen=/run/kvpool' "$unit" || fail "ExecStart does not listen in /run/kvpool"
user=$(setting User)
group=$(setting Group)
[[ -n "$user" && -n "$group" ]] || fail "no User= and Group="

# 4. sysusers creates exactly that user, in that group.
if command -v systemd-sysusers >/dev/null; then
  mkdir -p "$tmp/root/etc"
  systemd-sysusers --root="$tmp/root" "$deploy/kvpoold.sysusers" >/dev/null 2>&1 ||
    fail "systemd-sysusers rejected deploy/kvpoold.sysusers"
  gid=$(awk -F: -v g="$group" '$1 == g { print $3 }' "$tmp/root/etc/group")
  [[ -n "$gid" ]] || fail "sysusers creates no group $group"
  awk -F: -v u="$user" -v g="$gid" '$1 == u && $4 == g { found = 1 } END { exit !found }' \
    "$tmp/root/etc/passwd" || fail "sysusers creates no user $user with primary group $group"
  echo "sysusers: $user:$group"
fi

# 5. Group members reach the sockets; others do not.
dir_mode=$((8#$(setting RuntimeDirectoryMode)))
(( (dir_mode & 8#050) == 8#050 && (dir_mode & 8#007) == 0 )) ||
  fail "RuntimeDirectoryMode $(setting RuntimeDirectoryMode) is not group r-x, others nothing"
socket_mode=$(sed -n 's/^socket_mode: *\([0-9]*\).*/\1/p' "$deploy/kvpoold.textproto")
[[ -n "$socket_mode" ]] || fail "no socket_mode in deploy/kvpoold.textproto"
(( (socket_mode & 8#060) == 8#060 && (socket_mode & 8#007) == 0 )) ||
  fail "socket_mode $socket_mode is not group rw, others nothing"

# 6. TCP (docs/systemd.md): the unit alone allows Unix sockets only, so the metrics endpoint and
# a Redis tier over TCP need deploy/kvpoold-network.conf; with it as a drop-in the unit still
# verifies clean, may make IPv4 sockets, and its exposure stays at or below kMaxNetworkExposure.
readonly kMaxNetworkExposure=15
[[ "$(setting RestrictAddressFamilies)" == AF_UNIX ]] ||
  fail "the unit allows more than AF_UNIX: docs/systemd.md says it does not"
mkdir -p "$tmp/net/kvpoold.service.d"
cp "$unit" "$tmp/net/kvpoold.service"
cp "$deploy/kvpoold-network.conf" "$tmp/net/kvpoold.service.d/network.conf"
if ! verify=$(cd "$tmp/net" && systemd-analyze verify --man=no "$tmp/net/kvpoold.service" 2>&1) ||
    [[ -n "$verify" ]]; then
  fail "systemd-analyze verify with the network drop-in: ${verify:-non-zero exit}"
fi
status=0
security=$(systemd-analyze security --offline=yes --threshold="$kMaxNetworkExposure" \
             "$tmp/net/kvpoold.service" 2>&1) || status=$?
echo "$security" | grep -q '✗ RestrictAddressFamilies=~AF_(INET|INET6)' ||
  fail "the network drop-in does not allow Internet sockets (was it read?)"
score=$(echo "$security" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
echo "exposure with the network drop-in: $score (at most 1.$((kMaxNetworkExposure - 10)))"
[[ $status -eq 0 ]] || fail "exposure with the network drop-in $score is above the bound"
echo "PASS"
