"""A tiny OpenAI-compatible streaming server for the openai runner's tests (run as a child process).

python -m tests.search.fake_openai PORT [--leak-mib N] [--die-at K] [--hang-at K]
  --leak-mib N: keep N MiB (touched) per request, forever: the leaking server --soak must catch
  --die-at K / --hang-at K: on request K (1-based), after the first token, exit at once / stop answering
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import time

HELD: list[bytearray] = []
COUNT = [0]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        args = self.server.args  # type: ignore[attr-defined]
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        COUNT[0] += 1
        if args.leak_mib:
            HELD.append(bytearray(b"x" * (args.leak_mib * 2**20)))
        prompt = sum(len(m["content"]) for m in req["messages"]) // 4
        n = req.get("max_tokens", 16)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        time.sleep(0.002 * prompt / 100)  # "prefill"
        for i in range(n):
            ev = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
            self.wfile.flush()
            if i == 0 and COUNT[0] == args.die_at:
                os._exit(3)
            if i == 0 and COUNT[0] == args.hang_at:
                time.sleep(3600)
            time.sleep(0.002)
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--leak-mib", type=int, default=0)
    ap.add_argument("--die-at", type=int, default=0)
    ap.add_argument("--hang-at", type=int, default=0)
    args = ap.parse_args()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    srv.args = args  # type: ignore[attr-defined]
    srv.daemon_threads = True
    srv.serve_forever()


if __name__ == "__main__":
    main()
