"""The OpenAI-compatible HTTP server: a lean ASGI app over an `AsyncEngine`, run by uvicorn."""
