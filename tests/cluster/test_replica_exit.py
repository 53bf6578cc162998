"""A cluster replica's `spanq serve` (started through `supervise`, as `SpanReplica` starts it, the engine core in a
process of its own): it serves span queries as stock where its workers cannot move keys, and it ends with its
engine core within a bound when its supervisor is killed outright (Ray kills a dead replica actor's children so;
the server gets its parent-death SIGTERM): while its engine core starts, and while it streams an answer. And
`ExitGuard`, which bounds that, on its own (no engine)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from spanq_backend.serving.processes import descendants, identities, processes
from spanq_integrations.query.spnl_json import to_json
from tests.backend.test_span_support import docs, query
from tests.servers import START_TIMEOUT_S, Supervised, cmdline, log_tail, start_supervised, wait_for

EXIT_BOUND_S = 45  # spanq serve's deadline after a SIGTERM (30 s), and room for a loaded machine


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def assert_gone(pids: list[int], log: Path) -> None:
    deadline = time.monotonic() + EXIT_BOUND_S
    while left := [p for p in pids if alive(p)]:
        if time.monotonic() > deadline:
            described = ", ".join(f"{p} {cmdline(p)[:60]!r}" for p in left)
            pytest.fail(f"still running {EXIT_BOUND_S} s after the supervisor was killed: {described}\n{log_tail(log)}")
        time.sleep(0.5)


def engine_core(server: int) -> int:
    return next((p for p in descendants(server) if cmdline(p).startswith(b"VLLM::EngineCore")), 0)


@pytest.fixture(scope="module")
def tiny_gpt2(tiny_model: Path, tmp_path_factory) -> Path:
    """A tiny random GPT-2 (learned absolute positions, no rotary embedding) with SmolLM2's tokenizer: its
    config passes the start-up check, and the worker's relocation runtime refuses it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path_factory.mktemp("tiny-gpt2")
    config = GPT2Config(vocab_size=49152, n_positions=2048, n_embd=64, n_layer=2, n_head=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(out)
    for name in os.listdir(tiny_model):
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(tiny_model / name, out / name)
    return out


@pytest.fixture(scope="module")
def supervised(tiny_gpt2: Path, tmp_path_factory) -> Iterator[Callable[[], Supervised]]:
    """The module's replica-like `spanq serve` on the tiny GPT-2, whose worker cannot move keys: a factory that
    returns the running one, or starts one where there is none or it was ended. One start (~50 s: two processes
    import vLLM) serves the span queries below and then the streaming exit, which kills it."""
    running: list[Supervised] = []

    def get() -> Supervised:
        if not running or not running[-1].alive():
            log = tmp_path_factory.mktemp("supervised-serve") / "serve.log"
            running.append(start_supervised(tiny_gpt2, log, "--max-model-len", "2048"))
        return running[-1]

    yield get
    for server in running:
        server.kill_group()


@pytest.mark.vllm
@pytest.mark.slow
def test_spanq_serve_with_workers_in_other_processes_serves_span_queries_as_stock(supervised):
    server = supervised()
    wait_for("spanq serve answered", server.healthy, START_TIMEOUT_S, server.log)
    d = docs("p")
    answers = []
    for order in ("ABCD", "DCBA"):
        r = httpx.post(f"{server.url}/v1/query/execute", json=to_json(query(d, order)), timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json())
    text = server.log.read_text(errors="replace")
    assert "EngineCore" in text  # the engine core did run in a process of its own
    for body in answers:
        usage = body["usage"]
        assert usage["span_fallback"] and "keys cannot be moved" in usage["span_fallback"], usage
        assert usage["prepared_spans"] == 0 and usage["padded_tokens"] == 0
    # The engine core (its own process) ignores span tables too, whatever a client sends.
    assert "span tables run as stock requests" in text, log_tail(server.log)
    assert json.dumps(answers[1]["calls"][0]["fallback"]) != "null"


@pytest.mark.vllm
@pytest.mark.slow
def test_a_replica_whose_supervisor_is_killed_while_its_engine_core_starts_exits_with_it(tiny_model, tmp_path):
    log = tmp_path / "serve.log"
    replica = start_supervised(tiny_model, log)
    try:
        wait_for("the engine core started", lambda: engine_core(replica.server), START_TIMEOUT_S, log)
        time.sleep(1)  # the server now waits for its engine core to report
        started = [replica.server, *descendants(replica.server)]
        os.kill(replica.supervisor.pid, signal.SIGKILL)
        replica.supervisor.wait()
        assert_gone(started, log)
    finally:
        replica.kill_group()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_replica_streaming_an_answer_exits_when_its_supervisor_is_killed(supervised):
    """On the module's server, after the span-queries test (its last user: a later one would get a new one)."""
    replica = supervised()
    try:
        wait_for("spanq serve answered", replica.healthy, START_TIMEOUT_S, replica.log)
        streaming = threading.Event()
        served = httpx.get(f"{replica.url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": served, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 1900,
                "ignore_eos": True, "stream": True}  # fmt: skip

        def stream() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "POST", f"{replica.url}/v1/chat/completions", json=body, timeout=None
            ) as answer:
                if answer.status_code == 200:  # an error's body is not an answer streaming
                    for _ in answer.iter_lines():
                        streaming.set()

        threading.Thread(target=stream, daemon=True).start()
        assert streaming.wait(120), log_tail(replica.log)
        started = [replica.server, *descendants(replica.server)]
        assert engine_core(replica.server) in started  # the engine core streams from a process of its own
        os.kill(replica.supervisor.pid, signal.SIGKILL)
        replica.supervisor.wait()
        assert_gone(started, replica.log)
    finally:
        replica.kill_group()


GUARDED = textwrap.dedent("""
    import asyncio, signal, subprocess, sys
    from spanq_backend.serving.processes import ExitGuard

    guard = ExitGuard(deadline_s=2)
    guard.install()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(child.pid, flush=True)
    if sys.argv[1] == "starting":
        print("ready", flush=True)
        child.wait()

    async def main():
        follow = asyncio.ensure_future(guard.follow_graceful(0.05))
        # a server's graceful shutdown that never ends
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: print("graceful", flush=True))
        await follow
        print("ready", flush=True)
        await asyncio.sleep(300)

    asyncio.run(main())
""")


@pytest.mark.parametrize("phase", ["starting", "serving"])
def test_exit_guard_ends_the_process_and_what_it_started(phase):
    """Before a graceful handler is taken over, a SIGTERM kills at once; after, the graceful handler runs, and
    the process is still ended at the deadline."""
    proc = subprocess.Popen([sys.executable, "-c", GUARDED, phase], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "ready"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        took = time.monotonic() - sent
        if phase == "serving":
            assert proc.stdout.read().strip() == "graceful"
            assert took >= 1.5, took
        else:
            assert took < 1.5, took
        wait_for("the child killed", lambda: not alive(child), 5)
    finally:
        proc.kill()
        proc.wait()


ADOPTING = textwrap.dedent("""
    import os, subprocess, sys, time
    from spanq_backend.serving.processes import adopt_orphans, descendants, end_all, identities, reap_adopted

    adopting = sys.argv[1] == "adopting"
    if adopting:
        assert adopt_orphans()
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    # a middle process that starts two and exits: one orphan that ignores SIGTERM, one that exits soon after
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(300)"
    middle = subprocess.run(
        [sys.executable, "-c", f"import subprocess, sys; "
         f"a = subprocess.Popen([sys.executable, '-c', {stubborn!r}], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL); a.stdout.readline(); "
         f"b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.3)']); print(a.pid, b.pid)"],
        capture_output=True, text=True, check=True,
    )
    orphan, done = map(int, middle.stdout.split())
    time.sleep(0.5)
    print("among descendants:", orphan in descendants(os.getpid()), flush=True)
    if adopting:
        zombie = open(f"/proc/{done}/stat").read().rsplit(")", 1)[1].split()[0] == "Z" if os.path.exists(f"/proc/{done}") else None
        reap_adopted({own.pid})
        print("exited orphan reaped:", zombie and not os.path.exists(f"/proc/{done}"), flush=True)
        print("own child left to its Popen:", own.poll() is None, flush=True)
    started = identities(descendants(os.getpid()))
    sent = time.monotonic()
    killed = end_all(started, grace_s=1.0)
    print("ended:", orphan in killed and identities([orphan]) == {} and own.wait(5) is not None,
          round(time.monotonic() - sent, 1), flush=True)
    if not adopting:
        os.kill(orphan, 9)
""")


def test_the_cluster_command_adopts_what_its_ray_orphans_and_ends_it_within_a_bound():
    """`spanq serve --replicas` on a local Ray adopts the orphans of what it started (a replica's server outlives the
    Ray worker that started it; Ray's workers outlive the raylet), and at its exit ends them all, SIGKILL to what
    ignores a SIGTERM. Without adopting, an orphan goes to init and is out of reach: the check fails so."""
    run = subprocess.run([sys.executable, "-c", ADOPTING, "adopting"], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[:3] == ["among descendants: True", "exited orphan reaped: True", "own child left to its Popen: True"]
    ended, took = lines[3].rsplit(" ", 1)
    assert ended == "ended: True" and 0.9 <= float(took) < 8, lines[3]
    broken = subprocess.run([sys.executable, "-c", ADOPTING, "not"], check=False, capture_output=True, text=True, timeout=60)
    assert broken.stdout.splitlines()[0] == "among descendants: False", broken.stdout + broken.stderr


GROUP = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from spanq_backend.cluster import supervise
    from spanq_backend.serving.processes import identities

    os.setsid()  # this process leads a group of its own, as `supervise` does
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(300)"
    # a member that ignores SIGTERM, and one that, told to stop, starts another such member and exits
    joiner = (f"import signal, subprocess, sys, time\\n"
              f"def stop(*_):\\n"
              f"    late = subprocess.Popen([sys.executable, '-c', {stubborn!r}], stdout=subprocess.PIPE)\\n"
              f"    late.stdout.readline()\\n"
              f"    open(sys.argv[1], 'w').write(str(late.pid))\\n"
              f"    sys.exit(0)\\n"
              f"signal.signal(signal.SIGTERM, stop)\\n"
              f"print(flush=True)\\n"
              f"time.sleep(300)\\n")
    late_file = sys.argv[1] if sys.argv[1:] else "late.pid"
    members = [subprocess.Popen([sys.executable, "-c", code, late_file], stdout=subprocess.PIPE) for code in (stubborn, joiner)]
    for m in members:
        m.stdout.readline()
    sent = time.monotonic()
    supervise.end_group(grace_s=1.0)
    late = int(open(late_file).read())
    gone = [identities([p]) == {} for p in (*(m.pid for m in members), late)]  # gone or a zombie
    print("gone:", gone, round(time.monotonic() - sent, 1), flush=True)
    os.kill(late, 9) if not gone[-1] else None
""")


def test_supervise_ends_its_whole_group_also_what_joins_it_while_it_stops(tmp_path):
    """A supervisor's stop (`supervise.end_group`): SIGTERM to its group, SIGKILL after the grace to what ignores
    it, a member started during the stop included (a server starting a helper on its way out): none is left."""
    run = subprocess.run([sys.executable, "-c", GROUP, str(tmp_path / "late.pid")], check=False, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    gone, took = run.stdout.strip().rsplit(" ", 1)
    assert gone == "gone: [True, True, True]" and 0.9 <= float(took) < 10, run.stdout


STARTER = textwrap.dedent("""
    import os, subprocess, sys, time
    from spanq_backend.cluster.supervise import PARENT_ENV
    from spanq_backend.serving.processes import processes
    from tests.servers import cmdline

    env = dict(os.environ)
    if sys.argv[1] != "not named":  # as a replica starts its supervisor
        env[PARENT_ENV] = str(os.getpid())
    # (half a second late, as on a loaded machine: the starter is gone before the supervisor runs; `exec` keeps the
    # pid and the parent)
    supervisor = subprocess.Popen(["sh", "-c", 'sleep 0.5; exec "$@"', "sh",
                                   sys.executable, "-m", "spanq_backend.cluster.supervise",
                                   sys.executable, "-c", "import time; time.sleep(300)"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # (not the test's pipe)
    print(supervisor.pid, flush=True)
    if sys.argv[1] == "dies once it runs":  # the command started (not the shell's `sleep 0.5`): the supervisor is up
        while not any(b"sleep(300)" in cmdline(p) for p in processes(parent=supervisor.pid)):
            time.sleep(0.01)
    os._exit(0)  # killed, as Ray kills a replica: nothing stops the supervisor
""")


@pytest.mark.parametrize("starter", ["dies at once", "dies once it runs", "not named"])
def test_a_supervisor_whose_starter_dies_ends_with_its_command_even_before_it_was_up(starter):
    """A replica killed right after it started its supervisor (Ray stopping a deploy, the cluster command ended): the
    supervisor, its interpreter still starting, had not yet asked for its parent-death signal, so none came, and it
    ran its server for good. It ends now, with what it started, whenever its starter died: the starter names itself
    (`PARENT_ENV`). A supervisor not told its starter (the broken form) outlives one that dies at once."""
    run = subprocess.run([sys.executable, "-c", STARTER, starter], check=False, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    supervisor = int(run.stdout)

    def group() -> list[int]:  # the supervisor (its group is the test's until it is up) and the group it leads
        return sorted({*identities([supervisor]), *processes(group=supervisor)})

    try:
        deadline = time.monotonic() + (15 if starter != "not named" else 3)
        while (alive := group()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if starter == "not named":
            assert alive, "a supervisor not told its starter ended with it"
        else:
            assert not alive, f"left running after its starter died: {[cmdline(p) for p in alive]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor, signal.SIGKILL)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_cluster_command_stopped_while_its_replicas_start_ends_everything_it_started(tiny_model, tmp_path):
    """A SIGTERM to `spanq serve --replicas`'s process group while its replica starts (a service manager's stop, a
    deploy's timeout) ends the start-up as a Ctrl-C does: the command said nothing, Ray's core printed its stack
    dump, and the replicas' log folder stayed in /tmp, one a run."""
    pytest.importorskip("ray.serve", reason="the cluster extra: pip install 'spanq[cluster]'")
    import re

    from tests.servers import free_port

    log = tmp_path / "cluster.log"
    command = [sys.executable, "-m", "spanq_integrations.cli", "serve", "--replicas", "1", "--model", str(tiny_model),
               "--port", str(free_port())]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        said = wait_for("the cluster starting its replica",
                        lambda: re.search(r"replica logs in (\S+)", log.read_text(errors="replace")), 120, log)
        logs = Path(said.group(1))
        wait_for("the replica's server starting", lambda: list(logs.glob("replica-*.log")), 120, log)
        started = [p for p in descendants(proc.pid) if alive(p)]
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=EXIT_BOUND_S) == 0, log_tail(log)
        assert_gone(started, log)
        text = log.read_text(errors="replace")
        assert "stopped while the replicas were starting" in text and "Traceback" not in text, log_tail(log)
        assert not logs.exists(), "the replicas' log folder was left behind"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
