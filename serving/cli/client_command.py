"""`meshserve client`: prompts to a running `meshserve serve`, answers streamed; `--info` prints
GetServerInfo; `--lora-name` runs the prompts with one of the server's LoRA adapters."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshserve.serving import options
from meshserve.serving.grpc_api.client import Client, ClientError, StreamChunk

HELP = "prompts to a running `meshserve serve`"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051", help="the server's HOST:PORT")
    parser.add_argument("--prompt", action="append", default=[], help="repeat for several")
    parser.add_argument("--raw", action="store_true",
                        help="send prompts as plain text, not as a chat message")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="the server's api key")
    key.add_argument("--api-key-file", type=Path, default=None, help="read the api key from here")
    parser.add_argument("--tls-root-cert", type=Path, default=None,
                        help="PEM certificate to trust; connects with TLS")
    parser.add_argument("--tls", action="store_true",
                        help="connect with TLS, trusting the system's root certificates")
    parser.add_argument("--info", action="store_true", help="print GetServerInfo as JSON")
    parser.add_argument("--lora-name", default=None, metavar="NAME",
                        help="run the prompts with the LoRA adapter the server serves as NAME "
                             "(GetServerInfo's lora_names); unset: the base model")
    options.add_sampling_args(parser)


def run(args: argparse.Namespace) -> int:
    """Streams each prompt's answer to stdout (one after the other, each ending in a newline),
    its finish reason and usage to stderr; `--info` first prints GetServerInfo as JSON. Bad
    options raise ValueError or FileNotFoundError before anything is sent; a failed RPC exits 2
    with its status."""
    try:
        _run(args)
    except ClientError as err:
        print(f"meshserve: error: {err.code.name}: {err.message}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> None:
    if not args.prompt and not args.info:
        raise ValueError("give --prompt (repeatable) or --info")
    if args.lora_name is not None and not args.lora_name.strip():
        raise ValueError("--lora-name must name a served LoRA adapter; leave it out for the "
                         "base model")
    params = options.sampling_from_args(args)
    api_key = args.api_key
    if args.api_key_file is not None:
        if not args.api_key_file.is_file():
            raise FileNotFoundError(f"api key file {args.api_key_file} does not exist")
        api_key = args.api_key_file.read_text().strip()
        if not api_key:
            raise ValueError(f"api key file {args.api_key_file} is empty")
    if args.tls_root_cert is not None and not args.tls_root_cert.is_file():
        raise FileNotFoundError(f"TLS root certificate {args.tls_root_cert} does not exist")
    with Client(args.target, api_key=api_key, tls_root_cert=args.tls_root_cert,
                tls=args.tls) as client:
        if args.info:
            print(json.dumps(client.server_info().as_dict(), indent=2), flush=True)
        for prompt in args.prompt:
            if len(args.prompt) > 1:
                print(f">>> {prompt}", flush=True)
            message = prompt if args.raw else [{"role": "user", "content": prompt}]
            for item in client.stream(message, params, lora_name=args.lora_name):
                if isinstance(item, StreamChunk):
                    print(item.text, end="", flush=True)
                    continue
                print(flush=True)
                stop = "" if item.stop_reason is None else f" ({item.stop_reason!r})"
                print(f"[{item.finish_reason}{stop}] {item.prompt_tokens} prompt tokens "
                      f"({item.cached_tokens} cached), {item.completion_tokens} completion "
                      f"tokens", file=sys.stderr, flush=True)
