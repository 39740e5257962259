"""What a synthetic fleet runs: the requests' sizes, the workers' settings, the step cost.

The default is the issue's fleet figure: workers of 64 sequences at about 50 steps/s. A decode
step of 64 sequences costs about 20 ms (CostModel with an 18 ms fixed part, the simulator's
default per-token and per-KV-read parts), and a step with a prompt chunk in it more; the worker's
turn around the step (its Redis round trips, its own Python) comes on top. Requests are 64-192
prompt tokens and 128-384 output tokens (uniform), so that completions, and with them new
requests, come at an even pace rather than in waves; each goes to the lane the lane rule picks
(the default's to the normal lane, the quick run's short ones to the fast lane). The load keeps
`seqs_per_worker` + `intake_ahead` / 2 requests per worker in flight: every worker full, a few
more waiting in its engine, next to nothing waiting in Redis.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from producer.protocol import SamplingParams
from worker.config import WorkerConfig
from worker.engine.config import EngineConfig
from worker.engine.simulator import CostModel

BLOCK_SIZE = 16
VOCAB_SIZE = 49_152  # SmolLM2's: token ids as large as a real model's, so that events' ids take their bytes


@dataclass(frozen=True)
class Scenario:
    seqs_per_worker: int = 64
    fixed_step_ms: float = 18.0
    prompt_tokens: tuple[int, int] = (64, 192)
    output_tokens: tuple[int, int] = (128, 384)
    intake_ahead: int = 8  # the worker's default
    replay_ttl_s: int = 60  # short: finished requests' events need not outlive the run; Redis's memory stays small

    @property
    def cost(self) -> CostModel:
        return CostModel(fixed_s=self.fixed_step_ms / 1000)

    @property
    def in_flight_per_worker(self) -> int:
        return self.seqs_per_worker + self.intake_ahead // 2

    @property
    def decode_steps_per_s(self) -> float:
        """A full worker's step rate by the cost model alone (decodes at the mean context)."""
        context = (sum(self.prompt_tokens) + sum(self.output_tokens) / 2) / 2
        seqs = self.seqs_per_worker
        return 1 / self.cost.engine_time(seqs, round(seqs * context), seqs)

    @property
    def max_model_len(self) -> int:
        return self.prompt_tokens[1] + self.output_tokens[1]

    def engine_config(self) -> EngineConfig:
        """Seats for `seqs_per_worker` sequences, and twice the KV blocks that they and those waiting
        need at their longest, so that neither the watermark nor a preemption ever holds a request
        back (blocks cost nothing here: the pool only keeps their books)."""
        blocks_each = -(-self.max_model_len // BLOCK_SIZE)
        return EngineConfig.from_options("fleet-simulator", block_size=BLOCK_SIZE,
                                         num_blocks=2 * blocks_each * (self.seqs_per_worker + self.intake_ahead),
                                         max_num_seqs=self.seqs_per_worker, max_model_len=self.max_model_len)

    def worker_config(self, redis_url: str, cluster: bool, name: str) -> WorkerConfig:
        """The worker's own defaults (heartbeats, reclaims, intake) but for: no metrics port, a
        shutdown that hands back at once, and the shorter replay TTL."""
        return WorkerConfig(engine=self.engine_config(), redis_url=redis_url, redis_cluster=cluster, name=name,
                            intake_ahead=self.intake_ahead, replay_ttl=self.replay_ttl_s, drain_timeout=0,
                            log_level="warning")

    def request(self, rng: random.Random) -> tuple[list[int], SamplingParams]:
        """A request's prompt ids and sampling parameters (the fake model stops at max_tokens)."""
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*self.prompt_tokens))]
        return prompt, SamplingParams(max_tokens=rng.randint(*self.output_tokens), ignore_eos=True)


QUICK = Scenario(output_tokens=(16, 48))  # --quick: requests end within a short window
