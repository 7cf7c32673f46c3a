"""llama.cpp's OpenAI server (`python -m llama_cpp.server`), run with the llamacpp peer's python.

    python bench/peer_runners/llamacpp_server.py --model M.gguf --host 127.0.0.1 --port P [its flags]

The same server with one change: its request-id middleware accepts any X-Request-Id instead of
answering 400 to ids that are not UUIDs. vLLM's benchmark client sends "bench-<hex>-<n>" ids, so
without this every request fails before it reaches the model.
"""

from __future__ import annotations

from typing import Any

if __name__ == "__main__":
    import starlette_context.plugins

    class LenientRequestIdPlugin(starlette_context.plugins.RequestIdPlugin):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **(kwargs | {"validate": False}))

    # Before llama_cpp.server.app imports the name.
    starlette_context.plugins.RequestIdPlugin = LenientRequestIdPlugin  # type: ignore[misc]

    from llama_cpp.server.__main__ import main

    main()
