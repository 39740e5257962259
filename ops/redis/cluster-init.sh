#!/bin/sh
# Forms compose's Redis Cluster (the cluster profile) once: its six nodes, redis-node-0..5, as three
# masters each with a replica. Run by the redis-cluster-init service once every node is up; a
# cluster formed at an earlier `up` is left as it is. As the operator (its password from its secret,
# never on a command line); the replicas log in to their masters as `replicator` (start.sh).
set -eu
REDISCLI_AUTH="$(cat "${SECRETS_DIR:-/run/secrets}/redis_operator_password")"
export REDISCLI_AUTH
port=${REDIS_PORT:-6379}
prefix=${NODE_PREFIX:-redis-node-}
nodes=""
for i in 0 1 2 3 4 5; do nodes="$nodes $prefix$i:$port"; done
formed() { redis-cli --user operator -h "${prefix}0" -p "$port" cluster info | grep -q '^cluster_state:ok'; }
# Every node up first (compose waits for their healthchecks; podman-compose does not).
for i in 0 1 2 3 4 5; do
    tries=0
    until redis-cli --user operator -h "$prefix$i" -p "$port" ping 2>/dev/null | grep -q PONG; do
        tries=$((tries + 1))
        if [ "$tries" -ge 120 ]; then echo "redis-cluster-init: $prefix$i does not answer" >&2; exit 1; fi
        sleep 0.5
    done
done
if formed; then
    echo "redis-cluster-init: the cluster is formed already"
    exit 0
fi
# shellcheck disable=SC2086 # the node list is words by design
redis-cli --user operator --cluster create $nodes --cluster-replicas 1 --cluster-yes
for _ in $(seq 1 60); do
    if formed; then
        echo "redis-cluster-init: formed"
        exit 0
    fi
    sleep 1
done
echo "redis-cluster-init: the cluster did not reach cluster_state:ok within 60 s" >&2
exit 1
