"""`spanq serve` on a CPU in each engine mode, one after the other: the model runner in the engine core's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, spanq's CPU default since 2026-12-06) and in a process of its own (`=1`, vLLM's
default). Per mode: time to first token of span queries over documents the server has not seen (cold) and has (warm,
in another order), and of a stock chat completion over as much text (the time to a one-token answer); decode speed
of a 64-token streamed answer, once the engine is idle (the cold documents are prepared as spans when it is); the
time from the command to a server that answers. Wall times at the client, medians over `--reps`. `--serve-args`
passes more arguments to every server (`--no-enforce-eager`: the model compiled, vLLM's own default).

    python scripts/serve_mode_check.py [--model default] [--docs 8] [--words 210] [--reps 5] [--modes 0,1] [--serve-args=...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spanq_integrations import cross, fragment, generate, plus, system, user
from spanq_integrations.query.spnl_json import to_json
from tests.servers import free_port, models_answer, running_server


def documents(rep: int, n: int, words: int) -> list[str]:
    vocab = ["harbour", "lantern", "copper", "meadow", "signal", "ledger", "orchard", "quarry", "beacon", "thistle"]
    return [f"Record {rep}-{i}. " + " ".join(f"The {vocab[(i + k) % 10]} of {rep}-{i} is {k}." for k in range(words // 7))
            for i in range(n)]  # fmt: skip


def one_token_s(url: str, path: str, body: dict) -> float:
    """Seconds to the whole answer of a one-token request (its time to first token, and one step)."""
    started = time.perf_counter()
    answer = httpx.post(f"{url}{path}", json=body, timeout=300)
    if answer.status_code != 200:
        raise SystemExit(f"{path}: HTTP {answer.status_code}: {answer.text[:500]}")
    return time.perf_counter() - started


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the engine runs and queues no request (vLLM's gauges in /metrics)."""
    import re

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        busy = sum(float(v) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text,
                                                 re.MULTILINE))  # fmt: skip
        if busy == 0:
            return
        time.sleep(0.2)


def decode_rate(url: str, name: str, prompt: str, tokens: int = 64) -> float:
    """Tokens a second after the first, of a streamed chat answer of `tokens` tokens."""
    started = time.perf_counter()
    first = None
    body = {"model": name, "stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if first is None and line.startswith("data:") and '"content":"' in line.replace(" ", ""):
                first = time.perf_counter()
    return (tokens - 1) / max(time.perf_counter() - (first or started), 1e-6)


def measure(mode: str, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=mode)
    command = [sys.executable, "-m", "spanq_integrations.cli", "serve", "--model", args.model, "--port", str(port),
               *args.serve_args.split()]
    launched = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serve-mode-") as work, \
            running_server(command, Path(work) / "serve.log", f"spanq serve (mode {mode})", env=env):
        start_s = time.perf_counter() - launched
        (name, *_) = models_answer(url)
        cold, warm, stock, decode = [], [], [], []
        for rep in range(args.reps + 1):  # the first is a warm-up, not counted
            docs = documents(rep, args.docs, args.words)

            def query(order: list[str]) -> dict:
                return to_json(generate(cross(system("Answer from the records."), plus(*[fragment(d) for d in order]),
                                              user("Which record names a beacon first?")), max_tokens=1, temperature=0.0))  # fmt: skip

            c = one_token_s(url, "/v1/query/execute", query(docs))
            w = one_token_s(url, "/v1/query/execute", query(docs[::-1]))
            text = "\n\n".join(reversed(documents(rep + 1000, args.docs, args.words)))
            s = one_token_s(url, "/v1/chat/completions", {
                "model": name, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "system", "content": "Answer from the records."},
                             {"role": "user", "content": text + "\n\nWhich record names a beacon first?"}]})  # fmt: skip
            wait_idle(url)  # (the cold documents are prepared as spans when the engine is idle: not beside this)
            d = decode_rate(url, name, f"Count from {rep}.")
            if rep:
                cold.append(c)
                warm.append(w)
                stock.append(s)
                decode.append(d)
        return {"start s": start_s, "span cold TTFT s": statistics.median(cold), "span warm TTFT s": statistics.median(warm),
                "stock cold TTFT s": statistics.median(stock), "decode tokens/s": statistics.median(decode)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--words", type=int, default=210)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--modes", default="0,1")
    parser.add_argument("--serve-args", default="", help="more `spanq serve` arguments, e.g. '--no-enforce-eager'")
    args = parser.parse_args()
    results = {}
    for mode in args.modes.split(","):
        results[mode] = measure(mode, args)
        print(f"VLLM_ENABLE_V1_MULTIPROCESSING={mode}: " + json.dumps({k: round(v, 4) for k, v in results[mode].items()}),
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
