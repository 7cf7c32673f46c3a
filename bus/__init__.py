"""The message bus: every cross-process type, the codec, sockets, the shared-memory ring."""
