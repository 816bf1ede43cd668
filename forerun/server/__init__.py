"""`forerun serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the online engine.

app.py (routes, admission, streaming), protocol.py (request bodies), params.py (request -> SamplingParams),
runs.py (one request's choices in the engine), format.py (response bodies), metrics.py (Prometheus),
errors.py (OpenAI error shape), cli.py (`forerun serve`).
"""
