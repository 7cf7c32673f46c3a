"""`pagebus run-batch`: JSONL in, JSONL out, through the same engine processes and request path as serve."""
