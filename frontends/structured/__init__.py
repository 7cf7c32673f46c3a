"""Structured outputs and tool calling on the frontend side: checking constraints before they reach
the engine (`validate`), and OpenAI tools (`tools`: prompt rendering, output parsing, the
constraint that enforces a required call). The worker side is `workers/structured.py`."""
