"""Serving, by front end:

    engine/       the engine core: Engine, EngineConfig, the admission check, the engine loop
    openai_api/   OpenAI's request model, structured output and tool calls (HTTP and LLM.chat)
    auth.py       the bearer-token check both network front ends use
    options.py    the command lines' shared flags, generated from the configs' field metadata
    http_api/     the OpenAI-compatible HTTP front end
    grpc_api/     the gRPC server and clients, the proto and its stubs (starts http_api when asked)
    python_api/   LLM and AsyncLLM
    cli/          the `meshserve` command line: the table of subcommands that run models
    bench/        measurement: benchmarks, load generation, peers, and their subcommands

The front ends import the engine core and `openai_api`, never the other way; the engine core
knows no front end, and nothing imports `cli/` (`tests/test_layout.py` holds the direction). `root/` is the import root `meshserve` itself (`meshserve.LLM`, ...);
`examples/` holds the demo's prompts.
"""
