"""The OpenAI-compatible server: app.py (HTTP: routes, body cap, API key, uvicorn, the thread
runner), protocol.py (request bodies, error shape), serving.py (one request through the engine)."""
