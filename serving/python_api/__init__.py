"""The in-process Python API: `LLM` (`llm`: batch generation, shaped like vLLM's offline `LLM`)
and `AsyncLLM` (`async_llm`: asyncio, on the engine loop). `meshserve.LLM` and
`meshserve.AsyncLLM` load them.
"""
