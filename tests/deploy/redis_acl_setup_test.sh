#!/usr/bin/env bash
# deploy/setup-redis-acl.sh (what deploy/install-deps.sh runs) against a scratch /etc: it writes
# an owner-only password file and an ACL file that holds no plaintext password, includes it once,
# and a second run changes nothing; a redis-server started with the resulting redis.conf refuses
# anonymous clients, lets the `kvpool` user GET and SET block keys with its password and nothing
# else, and lets an administrator in with the default user's password.
#
#   redis_acl_setup_test.sh DEPLOY_DIR
#
# Skips (exit 77) when redis-server or redis-cli is not installed.
set -euo pipefail

deploy=$(cd "$1" && pwd)
fail() { echo "FAIL: $*" >&2; exit 1; }
for tool in redis-server redis-cli; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIPPED: $tool is not installed (deploy/install-deps.sh installs it)"
    exit 77
  fi
done

tmp=$(mktemp -d)
server=""
cleanup() {
  [[ -n "$server" ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$tmp/redis"
sock="$tmp/redis.sock"
cat > "$tmp/redis/redis.conf" <<CONF
port 0
unixsocket $sock
unixsocketperm 700
save ""
appendonly no
dir $tmp
CONF
setup() { KVPOOL_ETC="$tmp/kvpool" REDIS_ETC="$tmp/redis" KVPOOL_USER= "$deploy/setup-redis-acl.sh"; }

# 1. The files.
setup >/dev/null
pw_file="$tmp/kvpool/redis-password"
[[ $(stat -c %a "$pw_file") == 600 ]] || fail "redis-password has mode $(stat -c %a "$pw_file")"
pw=$(<"$pw_file")
[[ "$pw" =~ ^[0-9a-f]{64}$ ]] || fail "redis-password is not 64 hex digits"
admin=$(<"$tmp/redis/default-password")
[[ $(stat -c %a "$tmp/redis/default-password") == 600 ]] || fail "default-password not 0600"
acl="$tmp/redis/kvpool-acl.conf"
grep -qF "$pw" "$acl" && fail "the ACL file holds the kvpool password in plaintext"
grep -qF "$admin" "$acl" && fail "the ACL file holds the default password in plaintext"
[[ $(grep -cxF "include $acl" "$tmp/redis/redis.conf") == 1 ]] || fail "include line not there once"

# 2. Idempotent: a second run keeps the passwords and the files as they were.
before=$(cat "$acl" "$tmp/redis/redis.conf")
out=$(setup)
[[ "$out" == *"already set up"* ]] || fail "second run: $out"
[[ $(<"$pw_file") == "$pw" ]] || fail "second run changed the password"
[[ $(cat "$acl" "$tmp/redis/redis.conf") == "$before" ]] || fail "second run changed the files"
echo "setup-redis-acl: files right, second run a no-op"

# 3. A server with that config.
redis-server "$tmp/redis/redis.conf" --daemonize no --logfile "$tmp/redis.log" &
server=$!
for _ in $(seq 1 500); do [[ -S "$sock" ]] && break; sleep 0.02; done
[[ -S "$sock" ]] || fail "redis-server did not start: $(cat "$tmp/redis.log")"
anon() { redis-cli -s "$sock" "$@" 2>&1; }
as_kvpool() { redis-cli -s "$sock" --user kvpool --pass "$pw" --no-auth-warning "$@" 2>&1; }
[[ $(anon PING) == *NOAUTH* ]] || fail "anonymous PING answered: $(anon PING)"
[[ $(anon GET kvp2:x) == *NOAUTH* ]] || fail "anonymous GET answered"
[[ $(as_kvpool SET 'kvp2:{a}:b' value) == OK ]] || fail "kvpool SET: $(as_kvpool SET 'kvp2:{a}:b' v)"
[[ $(as_kvpool GET 'kvp2:{a}:b') == value ]] || fail "kvpool GET"
[[ $(as_kvpool PING) == PONG ]] || fail "kvpool PING"
set -f  # the commands below are split into words, never globbed ("KEYS *")
for denied in "SET other value" "GET other" "FLUSHALL" "KEYS *" "CONFIG GET requirepass" \
              "DEL kvp2:{a}:b" "ACL LIST"; do
  # shellcheck disable=SC2086
  [[ $(as_kvpool $denied) == *NOPERM* ]] || fail "kvpool may run: $denied"
done
set +f
[[ $(redis-cli -s "$sock" --user kvpool --pass wrong --no-auth-warning PING 2>&1) == *WRONGPASS* ]] ||
  fail "a wrong kvpool password was taken"
[[ $(REDISCLI_AUTH="$admin" redis-cli -s "$sock" ACL WHOAMI 2>&1) == default ]] ||
  fail "the administrator's password does not work"
echo "redis-server: no anonymous access; kvpool may GET/SET block keys only; admin gets in"
