"""Engine outputs -> protocol events, and one pipelined round trip per step (per node, on a
cluster) that writes them all.

Each request's events go through FENCED_WRITE: append to its replay stream (capped, with a
TTL) and publish on its channel (SPUBLISH on a cluster: the channel is in the request's slot, so
the fan-out stays on its node), only while its attempt key still holds this worker's
attempt of the entry (`Flight.fence`, claims.py). A worker that stalled past the reclaim
threshold, and so lost a request to another, cannot write one event more: the script answers
0 and the worker drops the request without acking it. Numbering (`seq`) is per request and continues across attempts.
The same script keeps the request's submission key (`Keys.submitted`) alive at least as long
as its replay stream, and with the terminal event gives both the same TTL: consumers find the
id as long as its events, and once both expire they are told it expired (producer/core.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from producer.connect import REPLICATION_WAIT_MS, is_cluster
from producer.protocol import FIELD, TERMINAL, DoneEvent, ErrorEvent, Event, TokenEvent, encode
from worker.engine.outputs import RequestOutput
from worker.flight import Flight
from worker.scripts import Batch, Script

FENCED_WRITE = """
-- KEYS: attempt key, replay stream, submission key.
-- ARGV: fence (the attempt key's value for this writer), channel, field, maxlen, ttl, terminal (1/0),
--       the publish command (PUBLISH, or SPUBLISH on a cluster), event...
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
for i = 8, #ARGV do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', ARGV[3], ARGV[i])
  redis.call(ARGV[7], ARGV[2], ARGV[i])
end
redis.call('EXPIRE', KEYS[2], ARGV[5])
if ARGV[6] == '1' then
  redis.call('EXPIRE', KEYS[3], ARGV[5])
else
  redis.call('EXPIRE', KEYS[3], ARGV[5], 'GT')
end
return 1
"""


class Outbox:
    def __init__(self, client, replay_maxlen: int, replay_ttl: int) -> None:
        self.client = client
        self.replay_maxlen, self.replay_ttl = replay_maxlen, replay_ttl
        self.script = Script(client, FENCED_WRITE)
        self.cluster = is_cluster(client)
        self.publish = "SPUBLISH" if self.cluster else "PUBLISH"

    # --- events ------------------------------------------------------------------------
    def add_output(self, flight: Flight, output: RequestOutput) -> None:
        if output.token_ids or output.text:
            self._add(flight, TokenEvent(seq=flight.next_seq, attempt=flight.attempt, ids=output.token_ids,
                                         text=output.text, logprobs=output.logprobs or None))
        if output.finished:
            self._add(flight, DoneEvent(seq=flight.next_seq, attempt=flight.attempt,
                                        finish_reason=output.finish_reason, usage=output.usage,
                                        timings=output.timings, error=output.error))

    def add_error(self, flight: Flight, code: str, message: str) -> None:
        self._add(flight, ErrorEvent(seq=flight.next_seq, attempt=flight.attempt, code=code, message=message))

    @staticmethod
    def _add(flight: Flight, event: Event) -> None:
        flight.pending.append(encode(event))
        flight.next_seq += 1
        flight.finished = flight.finished or isinstance(event, TERMINAL)

    # --- the step's one round trip -----------------------------------------------------
    def flush(self, flights: Iterable[Flight]) -> list[tuple[Flight, bool]]:
        """Write every pending event; -> (flight, written) for each flight that had some,
        written=False meaning another worker holds the request now."""
        flights = [flight for flight in flights if flight.pending]
        if not flights:
            return []
        batch = Batch(self.client)
        for flight in flights:
            request_id, keys = flight.request_id, flight.keys
            batch.run(self.script, (keys.attempt(request_id), keys.replay(request_id), keys.submitted(request_id)),
                      (flight.fence, keys.tokens(request_id), FIELD, self.replay_maxlen, self.replay_ttl,
                       int(flight.finished), self.publish, *flight.pending))
        written = batch.execute()
        for flight in flights:
            flight.pending.clear()
        self._replicated([flight for flight, ok in zip(flights, written) if ok and flight.finished])
        return [(flight, bool(ok)) for flight, ok in zip(flights, written)]

    def _replicated(self, finished: list[Flight]) -> None:
        """On a cluster, before the finished requests' entries are acked (on other nodes): wait until
        the nodes holding their events have sent them to a replica (WAIT, one round trip per node),
        so that a failover cannot keep an ack whose request's end it lost (nobody would finish it
        again). A node without a replica costs up to REPLICATION_WAIT_MS, then the ack goes on."""
        if not self.cluster or not finished:
            return
        nodes = {node.name: node for node in (self.client.get_node_from_key(flight.keys.replay(flight.request_id))
                                              for flight in finished)}
        pipe = self.client.pipeline(transaction=False)
        for node in nodes.values():
            pipe.execute_command("WAIT", 1, REPLICATION_WAIT_MS, target_nodes=node)
        pipe.execute()
