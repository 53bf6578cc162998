"""An OpenAI-compatible server that answers "ok" (streamed) and appends each request's path and body to a JSON-lines
file: `python openai_recorder.py LOG`, which prints its port once it listens. Run in a process of its own: spnl's
executor holds the GIL while it waits for an answer, so a server thread in the test's own process never answers."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Recorder(BaseHTTPRequestHandler):
    log_path = ""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        with open(self.log_path, "a") as log:
            log.write(json.dumps([self.path, body]) + "\n")
        chat = self.path.endswith("/chat/completions")
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for piece, finish in (("ok", None), ("", "stop")):
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"role": "assistant", "content": piece}} if chat else {"text": piece})
            chunk = {"id": "r", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                     "model": body.get("model", ""), "choices": [choice]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


if __name__ == "__main__":
    Recorder.log_path = sys.argv[1]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    print(server.server_address[1], flush=True)
    server.serve_forever()
