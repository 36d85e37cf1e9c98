"""The worker side: what runs in each worker process.

``loop`` (the process contract: ``WorkerArgs``, ``main``; the search loop, running and
reporting tasks), ``outcome`` (a result's encoding), ``join`` (fork-join frames and the
blocking join), ``pings`` (children's completions to their parents), and ``agents``
(the agents living on this worker: the host).  Imports the shared structures
(stealer.shared) and the agents' shared API (stealer.agents), never the client side.
"""
