"""Speculative decoding in the worker: verification of drafts, and the draft-model proposer."""
