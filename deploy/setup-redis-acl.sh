#!/usr/bin/env bash
# Redis ACL for the local redis-server that deploy/install-deps.sh installs (docs/tiers.md):
#
#   - user `kvpool`, for the daemons: the rules in deploy/redis-kvpool-acl.rules and a random
#     password (32 bytes, as hex) in /etc/kvpool/redis-password, mode 0600, owned by the daemon's
#     user `kvpool` (deploy/kvpoold.sysusers) when it exists: what tiers.redis.password_file names;
#   - user `default` (what a client that does not AUTH gets): a random password of its own, in
#     /etc/redis/default-password (root, 0600), for administration (`REDISCLI_AUTH=$(cat
#     /etc/redis/default-password) redis-cli`): no anonymous access;
#   - both as `user` lines in /etc/redis/kvpool-acl.conf, which holds only the passwords' SHA-256
#     (`#<hex>`), included once at the end of /etc/redis/redis.conf;
#   - redis-server restarted when it runs under systemd and the ACL changed; otherwise it takes
#     the ACL at its next start.
#
# Idempotent: existing password files are kept (configs name them) and the ACL file is rewritten
# from them; a second run changes nothing and restarts nothing. Harmless where systemd is not
# running or redis-server is not installed (CI containers: tests start private redis-server
# processes with their own arguments, not /etc/redis/redis.conf). Run as root.
#
#   deploy/setup-redis-acl.sh
#   KVPOOL_ETC=DIR REDIS_ETC=DIR KVPOOL_USER= deploy/setup-redis-acl.sh   # elsewhere (tests)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
kvpool_etc=${KVPOOL_ETC:-/etc/kvpool}
redis_etc=${REDIS_ETC:-/etc/redis}
daemon_user=${KVPOOL_USER-kvpool}
conf="$redis_etc/redis.conf"
acl="$redis_etc/kvpool-acl.conf"
fail() { echo "setup-redis-acl: $*" >&2; exit 1; }

if [[ ! -f "$conf" ]]; then
  echo "setup-redis-acl: no $conf (redis-server is not installed here): nothing to do"
  exit 0
fi
if grep -Eq '^[[:space:]]*aclfile[[:space:]]' "$conf"; then
  echo "setup-redis-acl: $conf names an aclfile: add the kvpool user there by hand" \
       "(rules: $here/redis-kvpool-acl.rules); left as it is"
  exit 0
fi
rules=$(grep -Ev '^[[:space:]]*(#|$)' "$here/redis-kvpool-acl.rules")
[[ -n "$rules" && $(wc -l <<<"$rules") -eq 1 ]] || fail "redis-kvpool-acl.rules: need one line"

# ensure_password FILE: keeps FILE when it holds a password, else writes a new one (0600).
ensure_password() {
  if [[ ! -s "$1" ]]; then
    (umask 077 && od -An -vtx1 -N32 /dev/urandom | tr -d ' \n' > "$1.new" && mv "$1.new" "$1")
  fi
  chmod 0600 "$1"
}
# sha256 of the password in FILE as the daemon sends it (one trailing newline dropped).
password_sha() { printf '%s' "$(<"$1")" | sha256sum | cut -d' ' -f1; }

install -d -m 0755 "$kvpool_etc"
ensure_password "$kvpool_etc/redis-password"
if [[ -n "$daemon_user" ]] && getent passwd "$daemon_user" >/dev/null; then
  chown "$daemon_user:" "$kvpool_etc/redis-password"
elif [[ -n "$daemon_user" ]]; then
  echo "setup-redis-acl: no user $daemon_user yet: $kvpool_etc/redis-password stays root's;" \
       "run this again after systemd-sysusers (the daemon reads only a file of its own)"
fi
ensure_password "$redis_etc/default-password"

new_acl=$(cat <<ACL
# Written by kvpool's deploy/setup-redis-acl.sh; rewritten by it (docs/tiers.md).
user default on resetpass #$(password_sha "$redis_etc/default-password") ~* &* +@all
user kvpool on resetpass #$(password_sha "$kvpool_etc/redis-password") $rules
ACL
)
changed=0
if [[ ! -f "$acl" ]] || [[ "$(<"$acl")" != "$new_acl" ]]; then
  (umask 027 && printf '%s\n' "$new_acl" > "$acl.new" && mv "$acl.new" "$acl")
  changed=1
fi
if [[ $(id -u) -eq 0 ]] && getent group redis >/dev/null; then
  chgrp redis "$acl"  # redis-server reads it as user redis
fi
chmod 0640 "$acl"
if ! grep -qxF "include $acl" "$conf"; then
  printf '\n# kvpool: ACL users (deploy/setup-redis-acl.sh)\ninclude %s\n' "$acl" >> "$conf"
  changed=1
fi

if [[ $changed -eq 0 ]]; then
  echo "setup-redis-acl: ACL already set up ($acl)"
elif [[ -d /run/systemd/system ]] && systemctl is-active --quiet redis-server; then
  systemctl restart redis-server
  echo "setup-redis-acl: ACL written to $acl; redis-server restarted"
else
  echo "setup-redis-acl: ACL written to $acl; redis-server takes it at its next start"
fi
