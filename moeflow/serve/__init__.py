"""``moeflow serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching engine."""
