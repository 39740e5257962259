"""Tensor parallelism's processes: rank 0 is the engine's own, ranks 1..N-1 are started by it.

Rank 0 owns everything that decides: the scheduler (one chunk size and one preemption decision
per step, for every rank), the block tables, sampling and the outputs. Each step its runner sends
the step's StepInputs (plain ints: token ids, positions, block-table updates) to every other rank over a
pipe, and every rank runs the same forward on its shard of the model (sharding.py), writing its KV
heads into the same slots of a cache of the same geometry: one set of block tables serves all.
The ranks meet only in the all-reduces of the row-parallel layers (torch.distributed: gloo on
CPU, NCCL on CUDA, rank r on cuda:r). The step goes by pipe, not by a collective, so that a rank
waits for it as long as rank 0 stays idle, with no collective timeout running.

No rank survives the group's loss, and none half-serves:
- rank 0 watches the other ranks' processes; one that ends, or any failure of a step on rank 0
  (the ranks' collectives would be out of step: no later step could be trusted), ends rank 0's
  process at once with EXIT_RANK_LOST, before another heartbeat: its requests are reclaimed by
  other workers as after any crash, and its restart policy starts it again;
- a rank past 0 ends once rank 0 is gone: its pipe closes, its collective fails (gloo), and a
  thread watching its parent catches what neither shows (NCCL waits on a dead peer for ever).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import msgspec
import torch
import torch.distributed as dist

from worker.engine.config import EngineConfig
from worker.engine.disk_cache import Phase, quiet
from worker.engine.models import ModelInfo, load_model
from worker.engine.runner import StepInputs, runner_for
from worker.engine.sharding import shard_model

log = logging.getLogger(__name__)

EXIT_RANK_LOST = 71  # the status of a process that ended itself for a lost rank (EX_OSERR)
STOP, READY = b"", b"ready"  # rank 0 -> a rank: no more steps; a rank -> rank 0: its runner is built
PARENT_CHECK_S = 0.1


def rank_device(device: str, rank: int) -> str:
    """Rank r computes on cuda:r of the visible devices (on the CPU, all share it)."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def load_shard(config: EngineConfig, rank: int, on_phase: Phase = quiet):
    """-> (this rank's part of the model on its device, the tokenizer or None). A checkpoint is read
    whole on the host and split there, so that the device never holds more than the part."""
    return load_model(config.model, config.dtype, rank_device(config.device, rank), on_phase,
                      keep_part=lambda model: shard_model(model, rank, config.tensor_parallel))


def join_group(store: dist.Store, rank: int, config: EngineConfig) -> None:
    if torch.device(config.device).type == "cuda":
        torch.cuda.set_device(rank)
        # device_id: NCCL connects now, not in the first all-reduce, which may be inside a CUDA graph's capture
        dist.init_process_group("nccl", store=store, rank=rank, world_size=config.tensor_parallel,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=config.tensor_parallel)


class Ranks:
    """Rank 0's side: the other ranks' processes, each step sent to them, their ends watched."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        """Starts ranks 1..N-1 (each loads and splits the model, and builds a runner of this KV
        geometry) and joins their process group; call wait_ready() once rank 0's runner is built."""
        if dist.is_initialized():
            raise ValueError("this process is in a torch.distributed group already: one tensor-parallel "
                             "engine per process")
        self.store = dist.TCPStore("127.0.0.1", 0, config.tensor_parallel, is_master=True, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; a fork would copy rank 0's threads
        self.processes: list[multiprocessing.Process] = []
        self.pipes: list[multiprocessing.connection.Connection] = []
        for rank in range(1, config.tensor_parallel):
            ours, theirs = context.Pipe()
            process = context.Process(target=serve_rank, name=f"tensor-parallel-rank-{rank}", daemon=True,
                                      args=(config, rank, self.store.port, num_blocks, max_model_len,
                                            torch.get_num_threads(), theirs))
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        self.closing = threading.Event()
        threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True).start()
        atexit.register(self.close)  # before multiprocessing's own exit handler ends the ranks
        self.encoder = msgspec.msgpack.Encoder()
        join_group(self.store, 0, config)

    @property
    def pids(self) -> list[int]:
        """Of ranks 1..N-1, in order."""
        return [process.pid for process in self.processes]

    def wait_ready(self) -> None:
        """Until every rank has built its runner (one that dies instead ends this process)."""
        for pipe in self.pipes:
            pipe.recv_bytes()  # READY, the one thing a rank ever sends

    def run(self, inputs: StepInputs, compute: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor:
        """One step on every rank: `inputs` sent to the others, then `compute(inputs)`, rank 0's share."""
        message = self.encoder.encode(inputs)
        try:
            for pipe in self.pipes:
                pipe.send_bytes(message)
            return compute(inputs)
        except BaseException as error:  # a second Ctrl-C too: the other ranks would wait in a collective
            lost(f"a step failed on rank 0 ({type(error).__name__}: {error}); the ranks are out of step")

    def close(self) -> None:
        """Stop the other ranks and leave the group (at exit too, unless called before)."""
        if self.closing.is_set():
            return
        self.closing.set()
        atexit.unregister(self.close)
        for pipe in self.pipes:
            try:
                pipe.send_bytes(STOP)
            except OSError:  # that rank is gone already
                pass
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        dist.destroy_process_group()

    def _watch(self) -> None:
        ranks = {process.sentinel: (rank, process) for rank, process in enumerate(self.processes, 1)}
        ended = multiprocessing.connection.wait(list(ranks))
        if not self.closing.is_set():
            rank, process = ranks[ended[0]]
            process.join()
            lost(f"rank {rank} (pid {process.pid}) ended with status {process.exitcode}")


def lost(reason: str) -> NoReturn:
    """End this process now: without a rank, the engine can compute nothing, and a process that lingers
    would keep its requests (and beat its heartbeat) for nothing."""
    log.critical("tensor parallelism lost: %s; exiting with status %d, this worker's requests go to others",
                 reason, EXIT_RANK_LOST)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RANK_LOST)


def serve_rank(config: EngineConfig, rank: int, port: int, num_blocks: int, max_model_len: int, threads: int,
               pipe: multiprocessing.connection.Connection) -> None:
    """A rank past 0 (its process's target): join the group, load and split the model, build a runner
    of rank 0's KV geometry, then compute each step rank 0 sends until told to stop. It takes its
    orders from rank 0 alone: a Ctrl-C (or systemd's SIGTERM) meant for the whole process group is
    rank 0's to act on, by draining, then stopping this rank."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    _end_with_parent()
    torch.set_num_threads(threads)
    join_group(dist.TCPStore("127.0.0.1", port, config.tensor_parallel, is_master=False), rank, config)
    model, _ = load_shard(config, rank)
    info = ModelInfo.from_model(model).per_rank(config.tensor_parallel)
    runner = runner_for(config, model, info, num_blocks, max_model_len, rank_device(config.device, rank))
    pipe.send_bytes(READY)
    decoder = msgspec.msgpack.Decoder(StepInputs)
    try:
        while (message := pipe.recv_bytes()) != STOP:
            runner.compute(decoder.decode(message))
    except EOFError:
        sys.exit(f"tensor-parallel rank {rank}: rank 0 is gone")
    dist.destroy_process_group()


def _end_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(EXIT_RANK_LOST)

    threading.Thread(target=watch, name="tensor-parallel-parent-watch", daemon=True).start()
