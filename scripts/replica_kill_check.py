"""What a client sees right after one replica's server dies: `spanq serve --replicas 2` on the tiny model, both
replicas answering, one replica's `spanq serve` process killed, then `--queries` queries sent one after another
at once (before Ray Serve's health check replaces it). Counts the answers and the 5xx (each a query whose tries
all went to the dead replica). Repeated `--kills` times on the one cluster, each time once both answer again.

    python scripts/replica_kill_check.py [--routing default|affinity] [--queries 8] [--kills 3]

The cluster runs the code beside this script (its `spanq serve` is started in this checkout's folder). On older
code: copy the script into a worktree of it and run it there (`python ../wt/scripts/replica_kill_check.py`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from spanq_integrations import cross, fragment, generate, plus, system, user
from spanq_integrations.query.spnl_json import to_json
from tests.cluster.test_cluster_serve import Cluster
from tests.servers import free_port, running_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routing", default="default", choices=("default", "affinity"))
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    from spanq_backend.serving.models import tiny_model_path  # the tests' tiny model, built locally once

    model = tiny_model_path()
    root = Path(__file__).resolve().parents[1]
    os.chdir(root)  # `python -m` imports from the current folder first: the cluster runs this checkout's code
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="spanq-kill-")) / "cluster.log"
    command = [sys.executable, "-m", "spanq_integrations.cli", "serve", "--replicas", "2", "--routing", args.routing,
               "--model", str(model), "--port", str(port), "--queue-timeout", "10"]  # fmt: skip
    print(f"spanq from {root}; routing {args.routing}; log {log}")
    with running_server(command, log, "spanq serve --replicas 2") as proc:
        cluster = Cluster(f"http://127.0.0.1:{port}", proc.pid, log)
        totals = {"answered": 0, "5xx": 0}
        for kill in range(args.kills):
            cluster.wait_for_replicas(2)
            before = set(cluster.replica_servers())
            victim = sorted(before)[kill % 2]
            os.kill(victim, signal.SIGKILL)
            codes = []
            for q in range(args.queries):
                query = generate(cross(system("Answer briefly."), plus(fragment(f"Note {kill}-{q}: the lamp is red.")),
                                       user("What colour is the lamp?")), max_tokens=4, temperature=0.0)
                r = httpx.post(f"{cluster.url}/v1/query/execute", params={"stream": "false"}, json=to_json(query),
                               timeout=120)
                codes.append(r.status_code)
            answered, failed = sum(c == 200 for c in codes), sum(c >= 500 for c in codes)
            totals["answered"] += answered
            totals["5xx"] += failed
            print(f"kill {kill + 1}: {answered} of {args.queries} answered, {failed} 5xx: {codes}")
            deadline = time.monotonic() + 300
            while not (set(cluster.replica_servers()) - before) and time.monotonic() < deadline:
                time.sleep(2)  # Ray Serve's replacement
        print(f"in all: {totals['answered']} answered, {totals['5xx']} 5xx of {args.kills * args.queries}")


if __name__ == "__main__":
    main()
