"""The `meshserve` command line: `main` (the table of subcommands and the entry point) and the
subcommands that run models, one `<name>_command` module each: generate, batch, demo, serve,
client, convert (the measuring ones live in `meshserve.serving.bench`). Their shared flags (the
engine, server and cluster ones, generated from the configs' field metadata) are
`meshserve.serving.options`, which the measuring commands use too.

Each subcommand module exposes `HELP` (one line), `add_arguments(parser)` and `run(args)`, which
returns the exit status (None is 0) and raises ValueError or FileNotFoundError, with what to
change, for bad input. `python -m meshserve.serving.cli` runs the command line, as the
`meshserve` script does.
"""

import time

STARTED = time.perf_counter()  # before the heavy imports: startup timings count from here
