"""The OpenAI-compatible HTTP front end: the app (`app`: FastAPI on uvicorn, on the engine loop),
its edge (`edge`: CORS, the api key, x-request-id, what never reaches the app) and the response
renderers (`render`: OpenAI's JSON and stream chunks; `render_responses`: the Responses API's
response and events, read off `render`'s).
"""
