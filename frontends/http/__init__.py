"""The OpenAI-compatible HTTP server: a lean ASGI app over `AsyncEngineClient`, run by uvicorn."""
