"""stealer: run CPU-heavy Python work and agents on every core, with work stealing.

Public names only; each lives in its own module: the agents' API (stealer/agents/api.py),
the errors (stealer/errors.py), fork-join (stealer/forkjoin.py), and, loaded on first use,
the executor (stealer/client/executor.py: ``Executor``, ``recover``) and ``AgentRefs``
(stealer/client/agents_batch.py).  What users import (``import stealer``); a worker process
imports it too, before stealer.worker.loop, so it stays free of the client side.
"""

from typing import TYPE_CHECKING

from stealer.agents import Agent, AgentRef, Ctx
from stealer.agents.api import call_all, gather
from stealer.errors import (
    AffinityError,
    AgentDeadlock,
    AgentError,
    AgentNotFound,
    AgentStopped,
    BrokenExecutor,
    ClusterError,
    DeadlineExceeded,
    ExecutorShutdownError,
    JournalError,
    MailboxFull,
    NodeFencedError,
    NodeLostError,
    NotInTaskError,
    RemoteError,
    SerializationError,
    SharedMemoryFullError,
    StealerError,
    StepTimeout,
    WorkerCrashedError,
)
from stealer.forkjoin import Child, join, run_inline, spawn

if TYPE_CHECKING:
    from stealer.client.agents_batch import AgentRefs
    from stealer.client.executor import Executor, recover

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The executor (and with it the client side: pool, result thread, numpy) loads on first
    # use: a worker process imports stealer.worker.loop, which must not pay for the client.
    if name in ("Executor", "recover"):
        from stealer.client import executor

        return getattr(executor, name)
    if name == "AgentRefs":  # (what Executor.spawn_agents returns: client side, lazy too)
        from stealer.client import agents_batch as batch

        return batch.AgentRefs
    raise AttributeError(f"module 'stealer' has no attribute {name!r}")

__all__ = [
    "AffinityError",
    "Agent",
    "AgentDeadlock",
    "AgentError",
    "AgentNotFound",
    "AgentRef",
    "AgentRefs",
    "AgentStopped",
    "Ctx",
    "DeadlineExceeded",
    "MailboxFull",
    "StepTimeout",
    "BrokenExecutor",
    "Child",
    "ClusterError",
    "Executor",
    "ExecutorShutdownError",
    "JournalError",
    "NodeFencedError",
    "NodeLostError",
    "NotInTaskError",
    "RemoteError",
    "SerializationError",
    "SharedMemoryFullError",
    "StealerError",
    "WorkerCrashedError",
    "call_all",
    "gather",
    "join",
    "recover",
    "run_inline",
    "spawn",
]
