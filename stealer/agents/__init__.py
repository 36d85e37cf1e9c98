"""Agents: stateful objects that step and exchange messages on the executor's workers.

Modules: api (what users write and hold), options (validated spawn options),
mailbox (the directory and mailboxes in shared memory), runqueue (tiers,
EDF, round-robin), host (a worker's agents: turns, timers, migration,
checkpoints, supervision), client (spawn, send, call, stop from the client).
"""

from stealer.agents.api import Agent, AgentRef, Ctx

__all__ = ["Agent", "AgentRef", "Ctx"]
