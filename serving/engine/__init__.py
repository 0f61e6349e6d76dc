"""The engine core, below every front end: the `Engine` (`core`: schedule, execute, update, one
thread), its settings (`engine_config.EngineConfig`), the one admission check every front door
calls (`admission`), the engine loop that serves it to many threads (`loop`), what a caller sees
of a request (`streams`, `outputs`), structured output's grammars (`grammar`), the Prometheus
metrics (`metrics`), the multi-process plan stream (`multihost`), and the plainest greedy loop
over a runner (`greedy_reference`).

Nothing here knows gRPC, HTTP or OpenAI's request shapes; the front ends import from here.
"""
