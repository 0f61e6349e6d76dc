"""`meshserve generate`: answer prompts given on the command line, streamed.

Its stderr lines (load time, the compiled set, the first token) are what `meshserve bench
--startup` parses (`meshserve.serving.bench.bench.parse_startup`).
"""

from __future__ import annotations

import argparse
import sys
import time

from meshserve.serving import options
from meshserve.serving.cli import STARTED

HELP = "answer the given prompts, streamed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--raw", action="store_true",
                        help="feed prompts as plain text, without the chat template")
    options.add_sampling_args(parser)
    options.add_model_args(parser)


def run(args: argparse.Namespace) -> None:
    params = options.sampling_from_args(args)
    llm = options.load_llm(args, needs_tokenizer=True)
    engine = llm.engine
    for prompt in args.prompt:
        text = prompt if args.raw else options.chat(llm, [{"role": "user", "content": prompt}])
        engine.add_request(text, params, request_id=prompt)
    shown = {p: 0 for p in args.prompt}
    started = time.perf_counter()
    num_tokens = 0
    stream_one = len(args.prompt) == 1
    first_token = None
    while engine.has_unfinished():
        for out in engine.step():
            if first_token is None and out.outputs[0].token_ids:
                first_token = time.perf_counter() - STARTED
                print(f"meshserve: first token after {first_token:.1f} s", file=sys.stderr,
                      flush=True)
            text = out.outputs[0].text
            if stream_one:
                print(text[shown[out.request_id]:], end="", flush=True)
                shown[out.request_id] = len(text)
            elif out.finished:
                print(f"\n>>> {out.request_id}\n{text.strip()}")
            num_tokens += len(out.outputs[0].token_ids) if out.finished else 0
    elapsed = time.perf_counter() - started
    print(f"\n\n{num_tokens} tokens in {elapsed:.2f}s: {num_tokens / elapsed:.1f} tokens/s")
