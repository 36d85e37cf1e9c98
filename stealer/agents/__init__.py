"""Agents: stateful objects that step and exchange messages on the executor's workers.

This package holds what both sides of an agent share.  Modules: api (what users write and
hold: Agent, AgentRef, Ctx), message (the message format: encode and decode), options
(validated spawn options), mailbox (the directory and mailboxes in shared memory), jblob
(the journal's blobs and keys, without SQLite) and journal (the durable journal: store,
opening, recovery plan, inspection).  The agents' client (spawn, send, call, stop) is
stealer/client/agents.py and agents_batch.py; their host on a worker (turns, run queue,
timers, migration, checkpoints, supervision) is stealer/worker/agents/.  Imports only the
shared structures (stealer.shared), never either side.
"""

from stealer.agents.api import Agent, AgentRef, Ctx

__all__ = ["Agent", "AgentRef", "Ctx"]
