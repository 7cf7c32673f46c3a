"""Drivers for the peer engines, one per peer, each run by that peer's own venv python.

They must not import pagebus (or bench.common): their venvs do not have it. Each reads one JSON
job on stdin and prints one JSON result on stdout; see bench/peers.py for the job format.
"""
