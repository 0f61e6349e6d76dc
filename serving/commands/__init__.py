"""The `meshserve` subcommands that run models: generate, batch, demo, serve, client, convert.

Each module is one subcommand (the measuring ones live in `meshserve.serving.bench`) and exposes
`HELP` (one line), `add_arguments(parser)` and `run(args)`, which returns the exit status (None
is 0) and raises ValueError or FileNotFoundError, with what to change, for bad input.
`meshserve.serving.cli` holds the table of them.
"""

import time

STARTED = time.perf_counter()  # before the heavy imports: startup timings count from here
