"""python -m ops.fleet: the measured fleet model (issue 23).

Synthetic workers, each the real worker loop (worker.service.Worker: intake, claims, fenced event
writes, heartbeats, reclaims, acks) around an engine whose model is the simulator's (a fake model
sleeping the cost model's step time: ops/fleet/engine.py), fed by producers that keep every worker
full and followed by a live consumer on every request, against one Redis node, a cluster of one
master (ops/fleet/one_master_cluster.py) and a cluster of three (ops/local_cluster.py), each
master with a replica, every master capped to the same share of a core
(--node-cpu, a cgroup CPU quota: root; replicas are measured, not capped). N workers, then more,
until a master saturates (ops/fleet/ramp.py); each step measures every node's CPU and commands/s,
the events/s delivered to the consumers, and intake -> admit latency (ops/fleet/step.py).

    python -m ops.fleet [--node-cpu 0.05] [--workers 1,2,3,4,6,8] [--out DIR] [--json FILE]
    python -m ops.fleet --quick        # seconds per topology: 1 and 2 workers, short requests

It ends with the scaling to 3 masters (from one node, and from one master), a master's capacity
in events/s per core, what the consumers cost, and the masters a fleet of --fleet-workers needs
(ops/fleet/capacity.py): as measured, and with each master's capacity scaled to the few events per
round trip that a fleet on that many masters sends each (Redis's CPU per fenced write by pipeline
size, measured on a node of its own: ops/fleet/round_trips.py); --out writes fleet.json and
fleet.png there.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console

from ops.demo import redis_at
from ops.fleet.capacity import summarize
from ops.fleet.nodes import TOPOLOGIES, topology
from ops.fleet.plots import plot
from ops.fleet.ramp import RampOptions, ramp
from ops.fleet.round_trips import SCRIPTS_PER_SIZE, measure as measure_round_trips
from ops.fleet.report import step_line, steps_table, summary_table
from ops.fleet.scenario import QUICK, Scenario
from ops.tool import run_tool, wide_console

QUICK_ROUND_TRIP_SCRIPTS = 1_000  # per pipeline size and round, with --quick


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES), type=_names,
                        help="of node (one plain node), cluster-1 (cluster mode, one master) and cluster (three "
                             "masters), comma-separated (default all three, in that order)")
    parser.add_argument("--node-cpu", type=float, default=0.05,
                        help="each Redis master's CPU cap, in cores (default 0.05)")
    parser.add_argument("--workers", type=_counts, default=(1, 2, 3, 4, 6, 8),
                        help="the ramp's worker counts, rising (default 1,2,3,4,6,8)")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before each window (default 8)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds each step is measured over (default 20)")
    parser.add_argument("--workers-per-process", type=int, default=2,
                        help="synthetic workers sharing a process, each in a thread (default 2)")
    parser.add_argument("--load-processes", type=int, default=2,
                        help="processes of producers and live consumers, the requests shared out (default 2)")
    parser.add_argument("--fleet-workers", type=int, default=1000, help="the fleet the summary sizes (default 1000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true",
                        help="1 and 2 workers, 1 s warm-ups and 1 s windows, requests of 16-48 tokens")
    parser.add_argument("--out", type=Path, help="write fleet.json and the PNG plots here")
    parser.add_argument("--json", type=Path, help="write every figure here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.warmup, args.window = (1, 2), 1.0, 1.0
    if args.workers_per_process < 1 or args.load_processes < 1:
        parser.error("--workers-per-process and --load-processes must be at least 1")
    console = wide_console(200)
    return run_tool("fleet", lambda: measure(console, args, QUICK if args.quick else Scenario()), console)


def measure(console: Console, args: argparse.Namespace, scenario: Scenario) -> None:
    options = RampOptions(args.workers, args.warmup, args.window, args.workers_per_process, args.load_processes,
                          args.seed)
    ramps = {}
    with tempfile.TemporaryDirectory(prefix="streambatch-fleet-") as scratch:
        for kind in args.topologies:
            directory = Path(scratch) / kind
            directory.mkdir()
            with topology(kind, directory, args.node_cpu, console) as nodes:
                ramps[kind] = ramp(nodes, scenario, options, directory, lambda step: console.print(step_line(step)))
            console.print(steps_table(kind, ramps[kind]))
        with redis_at(None, Path(scratch), console) as url:  # after the ramps: nothing else runs meanwhile
            console.print("[bold]round trips:[/] Redis's CPU per fenced write, by scripts per pipeline ...")
            round_trips = measure_round_trips(url, QUICK_ROUND_TRIP_SCRIPTS if args.quick else SCRIPTS_PER_SIZE)
    summary = summarize(ramps, scenario, args.fleet_workers, round_trips)
    console.print(summary_table(summary))
    figures = {"scenario": vars(scenario) | {"cost": vars(scenario.cost)}, "node_cpu": args.node_cpu,
               "steps": {kind: [step.as_json() for step in steps] for kind, steps in ramps.items()},
               "summary": summary}
    for path in [args.json] + ([args.out / "fleet.json"] if args.out else []):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(figures, indent=2))
    if args.out is not None:
        console.print(f"[bold]plot:[/] {plot(ramps, args.out)}")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or set(names) - set(TOPOLOGIES):
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(TOPOLOGIES)}, got {text!r}")
    return names


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(count) for count in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected worker counts such as 1,2,4, got {text!r}") from None
    if not counts or min(counts) < 1 or list(counts) != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"worker counts must rise from 1 or more, got {text!r}")
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
