#!/bin/sh
# The Redis container's start (compose.yaml): users.acl (made by `python -m producer.acl`) with the
# gateway's, the worker's and the operator's password hashes filled in from their compose secrets, plus the tenant
# users that `streambatch tenant add` saved into the ACL file on the data volume (ACL SAVE) at an
# earlier run; then redis-server on that file, with the arguments given. A secret reaches no
# command line, no environment variable and no file but its SHA-256 in the ACL file. Rotating the
# worker's or the operator's password: change its secret file, restart Redis.
# (Paths from the environment, for tests/ops/test_redis_start.py.)
set -eu
template=${ACL_TEMPLATE:-/etc/streambatch/redis/users.acl}
secrets=${SECRETS_DIR:-/run/secrets}
acl=${ACL_FILE:-/data/users.acl}

# The SHA-256 of the password the clients read from the same file (producer.protocol.read_password
# drops one trailing newline; command substitution drops it here).
password_sha256() {
    if [ ! -s "$secrets/$1" ]; then
        echo "redis: the secret $1 is missing or empty ($secrets/$1): see compose.yaml's header" >&2
        exit 1
    fi
    printf %s "$(cat "$secrets/$1")" | sha256sum | cut -d' ' -f1
}
worker=$(password_sha256 redis_worker_password)
operator=$(password_sha256 redis_operator_password)
# The default user's: a hash of random bytes no one ever sees, so that no one can log in as it
# (producer/acl.py users_acl says why it cannot simply be off). The same for the gateway's while
# its secret is not there (a deployment without the gateway).
nobody() { head -c 32 /dev/urandom | sha256sum | cut -d' ' -f1; }
default=$(nobody)
if [ -s "$secrets/redis_gateway_password" ]; then gateway=$(password_sha256 redis_gateway_password); else gateway=$(nobody); fi

umask 077
{
    sed -e "s/@DEFAULT_PASSWORD_SHA256@/$default/" -e "s/@GATEWAY_PASSWORD_SHA256@/$gateway/" \
        -e "s/@WORKER_PASSWORD_SHA256@/$worker/" -e "s/@OPERATOR_PASSWORD_SHA256@/$operator/" "$template"
    if [ -f "$acl" ]; then grep '^user tenant-' "$acl" || true; fi
} > "$acl.new"
mv "$acl.new" "$acl"
exec redis-server --aclfile "$acl" "$@"
