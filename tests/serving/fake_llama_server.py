"""A stand-in for llama.cpp's `llama-server` that speaks its `/health` and streamed `/completion`
the way llama-server does (SSE over chunked HTTP/1.1, each event a JSON object with `content`,
`tokens`, `stop` and a running `tokens_predicted`), with an arithmetic next-token rule: output
token i of a request is (last prompt id + 1 + i) % VOCAB.

Like the real server it holds a token back while it completes a UTF-8 character: here every
`HOLD_EVERY`-th token is held, and the next event carries both tokens' text but, as
llama-server's does, only the newest token's id in `tokens`, while its `tokens_predicted` grows
by 2. The last event has `stop: true`, no tokens, and the final count.

Each stream opens with an SSE comment, the keep-alive llama-server sends every 30 s while a
request waits for a slot. `Behaviour` sets the timing (a delay before the first token and between tokens), a short output
(`missing_tokens` fewer than `n_predict`), an error event after the first token, a status code
for every completion, and `loading_polls` answers of 503 from `/health` before 200.

Run as a program (`python -m tests.serving.fake_llama_server` or the file itself) it takes
llama-server's flags, serves on `--host`/`--port` until SIGTERM, answers `--version`, writes its
argv as JSON to `$FAKE_LLAMA_SERVER_ARGV` when that is set, exits at once with status 3 and
a message when `$FAKE_LLAMA_SERVER_FAIL` is set, and kills itself with SIGSEGV on its first
`/completion` when `$FAKE_LLAMA_SERVER_SEGFAULT` is set (as a llama.cpp built with a crashing
CPU feature does on its first decode). Given `llama-batched-bench`'s `-npp`, it prints a
one-row table as that program does and exits 0 (the builder's smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 49152
HOLD_EVERY = 5


@dataclasses.dataclass
class Behaviour:
    first_token_delay: float = 0.0
    token_delay: float = 0.0
    missing_tokens: int = 0
    error_after_first: bool = False
    status: int = 200
    loading_polls: int = 0
    bodies: list = dataclasses.field(default_factory=list)  # every /completion body, in order


def output_tokens(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % VOCAB for i in range(n)]


def make_server(port: int = 0, behaviour: Behaviour | None = None,
                host: str = "127.0.0.1") -> ThreadingHTTPServer:
    behaviour = behaviour or Behaviour()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            if self.path != "/health":
                return self._json(404, {"error": {"code": 404, "message": "not found"}})
            with lock:
                loading = behaviour.loading_polls > 0
                behaviour.loading_polls -= loading
            if loading:
                return self._json(503, {"error": {"code": 503, "message": "Loading model"}})
            self._json(200, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            behaviour.bodies.append(body)
            if self.path != "/completion":
                return self._json(404, {"error": {"code": 404, "message": "not found"}})
            if os.environ.get("FAKE_LLAMA_SERVER_SEGFAULT"):
                os.kill(os.getpid(), signal.SIGSEGV)
            if behaviour.status != 200:
                return self._json(behaviour.status, {"error": {"code": behaviour.status,
                                                               "message": "refused"}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._stream(body)

        def _stream(self, body: dict):
            n = max(0, body["n_predict"] - behaviour.missing_tokens)
            tokens = output_tokens(body["prompt"], n)
            self._chunk(b":\n\n")  # the keep-alive llama-server sends while a request waits
            time.sleep(behaviour.first_token_delay)
            held: list[int] = []
            for i, token in enumerate(tokens):
                if i:
                    time.sleep(behaviour.token_delay)
                held.append(token)
                if (i + 1) % HOLD_EVERY == 0 and i + 1 < n:
                    continue  # sent with the next token, as a split UTF-8 character would be
                self._event({"content": "x" * len(held), "tokens": [token], "stop": False,
                             "tokens_predicted": i + 1, "tokens_evaluated": len(body["prompt"])})
                held = []
                if behaviour.error_after_first:
                    self._event({"error": {"code": 500, "message": "boom",
                                           "type": "server_error"}})
                    break
            else:
                self._event({"content": "", "tokens": [], "stop": True, "tokens_predicted": n,
                             "stop_type": "limit", "truncated": False})
            self._chunk(b"")

        def _event(self, event: dict):
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())

        def _chunk(self, data: bytes):
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _json(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str]) -> int:
    if "--version" in argv:
        print("version: 0 (fake)", file=sys.stderr)
        return 0
    if os.environ.get("FAKE_LLAMA_SERVER_FAIL"):
        print("error: failed to load model (as told to)", file=sys.stderr)
        return 3
    if "-npp" in argv:  # llama-batched-bench
        print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |")
        print("|     8 |      2 |    1 |     10 |    0.001 |  8000.00 |    0.001 |  2000.00 |")
        return 0
    if os.environ.get("FAKE_LLAMA_SERVER_ARGV"):
        with open(os.environ["FAKE_LLAMA_SERVER_ARGV"], "w") as handle:
            json.dump(argv, handle)
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    server = make_server(args.port, Behaviour(loading_polls=3), host=args.host)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on {args.host}:{args.port}", flush=True)
    server.serve_forever(poll_interval=0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
