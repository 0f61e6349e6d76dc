"""OpenAI's request surface, shared by the HTTP API and `LLM.chat`: the request model and its
field table (`request_model`, `fields`, `checks`, `chat_messages`), structured output and tool
calls (`structured_fields`, `tool_calls`), and the Responses API's request, read as a chat request
(`responses`).

Nothing here knows HTTP or the engine loop; of the engine it uses only the grammar library's JSON
options (`meshserve.serving.engine.grammar`), so tool calls bound numbers as every JSON
constraint does.
"""
