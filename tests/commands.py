"""Run several `spanq` command lines in one fresh process, through the command's own entry point: each one's exit
status and what it wrote to stderr. The imports (Ray's, and vLLM's where a command loads it) are paid once instead
of once per command line (for the tests of flags that must be refused before anything starts)."""

from __future__ import annotations

import json
import subprocess
import sys

_RUN = """
import contextlib, io, json, sys
from spanq_integrations.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def run_in_one_process(argvs: list[list[str]], timeout: float = 300) -> list[tuple[int, str]]:
    """`spanq ARGV...` for each argv, one after another in one new process: (exit status, stderr) for each."""
    done = subprocess.run([sys.executable, "-c", _RUN, json.dumps(argvs)],
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [(code, err) for code, err in json.loads(done.stdout.strip().splitlines()[-1])]
