#!/bin/sh
# The Redis container's start (compose.yaml): users.acl (made by `python -m producer.acl`) with the
# gateway's, the worker's, the operator's and the replicator's password hashes filled in from their
# compose secrets, plus the tenant users that `streambatch tenant add` saved into the ACL file on
# the data volume (ACL SAVE) at an earlier run; then redis-server on that file, with the arguments
# given. A secret reaches no command line, no environment variable and no file but its SHA-256 in
# the ACL file, and the replicator's own password in a config file only Redis reads (what a replica
# logs in to its master with). Rotating a password: change its secret file, restart Redis.
# REDIS_CLUSTER_NODE=<its hostname> makes the node a member of a Redis Cluster (compose's cluster
# profile; ops/redis/cluster-init.sh forms it), announced to clients by that name.
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
if [ -s "$secrets/redis_replicator_password" ]; then replicator=$(password_sha256 redis_replicator_password); else replicator=$(nobody); fi

umask 077
{
    sed -e "s/@DEFAULT_PASSWORD_SHA256@/$default/" -e "s/@GATEWAY_PASSWORD_SHA256@/$gateway/" \
        -e "s/@WORKER_PASSWORD_SHA256@/$worker/" -e "s/@OPERATOR_PASSWORD_SHA256@/$operator/" \
        -e "s/@REPLICATOR_PASSWORD_SHA256@/$replicator/" "$template"
    if [ -f "$acl" ]; then grep '^user tenant-' "$acl" || true; fi
} > "$acl.new"
mv "$acl.new" "$acl"

# How this node logs in to a master it replicates (a cluster's replica, or one an operator adds).
replication="$(dirname "$acl")/replication.conf"
{
    echo "masteruser replicator"
    if [ -s "$secrets/redis_replicator_password" ]; then echo "masterauth $(cat "$secrets/redis_replicator_password")"; fi
} > "$replication.new"
mv "$replication.new" "$replication"

if [ -n "${REDIS_CLUSTER_NODE:-}" ]; then
    set -- --cluster-enabled yes --cluster-config-file "$(dirname "$acl")/nodes.conf" \
        --cluster-node-timeout "${REDIS_CLUSTER_NODE_TIMEOUT_MS:-5000}" \
        --cluster-announce-hostname "$REDIS_CLUSTER_NODE" --cluster-preferred-endpoint-type hostname "$@"
fi
exec redis-server "$replication" --aclfile "$acl" "$@"
