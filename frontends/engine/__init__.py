"""The engine behind every frontend, and its wiring.

`interface` says what a frontend needs of an engine. Two implementations: `inproc.InprocEngine`
runs the scheduler and the model runner in this process; `client.AsyncEngineClient` (and
`sync_client.MultiprocEngine` over it) drives the multi-process engine that `launcher` starts:
tokenizer processes (`tokenizer_process`), the scheduler and one worker per GPU. This folder is
the only part of `frontends` that imports `scheduler` and `workers`.
"""
