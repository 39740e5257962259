"""A Redis Cluster of one master, holding every slot, and its replica: cluster mode's every cost
(the cluster clients, sharded pub/sub, WAIT for a replica, replication) with one master, the
baseline from which ops/fleet measures how events/s scale to LocalCluster's three.

`redis-cli --cluster create` wants 3 masters, so the slots and the replica are set by hand.
"""

from __future__ import annotations

import time

import redis

from ops.local_cluster import LocalCluster


class OneMasterCluster(LocalCluster):
    def __enter__(self) -> OneMasterCluster:
        master, replica = self.ports[:2]
        for port in (master, replica):
            self.start_node(port)
        for port in (master, replica):
            self.wait(lambda: redis.Redis(port=port).ping(), f"node {port} up")
        redis.Redis(port=master).execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        redis.Redis(port=replica).execute_command("CLUSTER", "MEET", "127.0.0.1", master)
        master_id = redis.Redis(port=master).execute_command("CLUSTER", "MYID").decode()
        self.wait(lambda: master_id in redis.Redis(port=replica).execute_command("CLUSTER", "NODES").decode(),
                  "the replica to know the master")
        redis.Redis(port=replica).execute_command("CLUSTER", "REPLICATE", master_id)
        self.wait(self.healthy, "the master's slots, and its replica synced")
        time.sleep(0.2)
        return self

    def healthy(self) -> bool:
        nodes = self.nodes()
        masters = [node for node in nodes if node["master"] and node["alive"] and node["slots"]]
        replicas = [node for node in nodes if not node["master"] and node["alive"]]
        return (len(masters) == 1 and len(replicas) == 1
                and all(redis.Redis(port=node["port"]).cluster("info")["cluster_state"] == "ok" for node in nodes)
                and redis.Redis(port=replicas[0]["port"]).info("replication").get("master_link_status") == "up")
