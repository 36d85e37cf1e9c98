"""The client side: what runs in the process that created the executor.

``executor`` (the public ``Executor`` facade: submit, map, agents), ``futures`` (cheap
Futures), ``pool`` (the result thread: completions, backlogs, worker start and watch),
``waiting`` (settling completions: the result thread's batches and a waiting thread's),
``deaths`` (what a worker's death means, and the recovery of what it held), ``ringfix``
(repair of a dead worker's half-done ring operations), ``hang`` (frozen workers),
``stats`` (``ex.stats()``), ``progress`` (map progress), ``agents`` and ``agents_batch``
(the agents' client: spawn, send, call, stop, final values).  Imports the shared
structures (stealer.shared) and the agents' shared API (stealer.agents), never the
worker side, except the worker's entry point (``stealer.worker.loop.main``) that it
starts processes with.
"""
