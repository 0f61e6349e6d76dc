"""The OpenAI-compatible HTTP front end: the app (`app`: FastAPI on uvicorn, on the engine loop),
its edge (`edge`: CORS, the api key, x-request-id, what never reaches the app) and the response
renderer (`render`: OpenAI's JSON and stream chunks).
"""
