"""python -m worker --redis-url URL --model MODEL [engine flags] [--metrics-port P] [--name NAME]

SIGTERM (or Ctrl-C) drains: intake stops, running requests get --drain-timeout seconds to
finish, the rest are handed back to the other workers, and the process exits 0. A second
Ctrl-C quits at once (what it held is reclaimed once idle).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from producer.protocol import PASSWORD_ON_COMMAND_LINE
from worker.config import parse_config, password_on_command_line
from worker.logs import configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level)
    if password_on_command_line(argv):
        import structlog

        structlog.get_logger("worker").warning("worker.password_on_command_line", advice=PASSWORD_ON_COMMAND_LINE)
    # only now: --help and a bad flag answer at once, without loading torch and transformers
    import redis
    import torch

    from worker.service import Worker

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        worker = Worker(config)
    except (ValueError, OSError, redis.RedisError) as error:  # a model, URL or password it cannot use, a port in use
        print(f"python -m worker: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # while loading, or waiting for Redis
        return 130

    def on_signal(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and worker.stopping:
            raise KeyboardInterrupt
        worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
