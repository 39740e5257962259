"""The worker's Lua scripts, run inside pipelines on one node or on a Redis Cluster.

Each script touches the keys of one hash tag (one request's, or one lane stream), so on a cluster
it runs on the node that owns them, and a pipeline of them goes out as one round trip per node.
redis-py's Script objects cannot be queued on a cluster pipeline (it refuses EVALSHA there), so
`Batch` sends raw EVALSHAs; a node that lost its script cache (a restart, a failover to a
replica that never loaded it) answers NOSCRIPT, and then exactly those calls (which did not run)
are sent again once the script is loaded on every primary.
"""

from __future__ import annotations

import hashlib

import redis


class Script:
    def __init__(self, client, body: str) -> None:
        self.client, self.body = client, body
        self.sha = hashlib.sha1(body.encode()).hexdigest()
        self.load()

    def load(self) -> None:
        """SCRIPT LOAD (on a cluster, redis-py sends it to every primary)."""
        self.client.script_load(self.body)


class Batch:
    """A non-transactional pipeline of commands (`pipe`) and script calls (`run`)."""

    def __init__(self, client) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=False)
        self.calls: dict[int, tuple[Script, tuple, tuple]] = {}  # by position in the pipeline

    def run(self, script: Script, keys: list | tuple, args: list | tuple) -> None:
        self.calls[len(self.pipe)] = (script, tuple(keys), tuple(args))
        self.pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    def execute(self, raise_on_error: bool = True) -> list:
        """The replies in order (errors in place unless `raise_on_error`, which raises the first)."""
        replies = self.pipe.execute(raise_on_error=False)
        missing = [position for position, reply in enumerate(replies)
                   if isinstance(reply, redis.exceptions.NoScriptError) and position in self.calls]
        if missing:
            for script in {self.calls[position][0] for position in missing}:
                script.load()
            again = Batch(self.client)
            for position in missing:
                again.run(*self.calls[position])
            for position, reply in zip(missing, again.execute(raise_on_error=False)):
                replies[position] = reply
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies
