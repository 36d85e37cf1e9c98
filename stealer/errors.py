"""Exceptions raised by stealer's public API.

One base class, :class:`StealerError`.  Where a ``concurrent.futures``
user already catches a standard exception, ours subclasses it too, so code
written for :class:`~concurrent.futures.ProcessPoolExecutor` keeps working:

    StealerError
     ├── BrokenExecutor        (also concurrent.futures.BrokenExecutor)
     │    └── WorkerCrashedError  (also concurrent.futures.process.BrokenProcessPool)
     │         └── NodeLostError   the cluster node running this task died (retries used up)
     ├── SerializationError    (also pickle.PicklingError)
     ├── ExecutorShutdownError (also RuntimeError, like submit-after-shutdown in the stdlib)
     ├── AffinityError         (also ValueError)
     ├── SharedMemoryFullError (also OSError) /dev/shm has no room for a new executor
     ├── NotInTaskError        (also RuntimeError)
     ├── RemoteError           a task's exception that could not be sent back as itself
     ├── ClusterError          Executor(cluster=...) cannot use the cluster (no Ray, no node)
     │    └── NodeFencedError  a node cut off from its client stopped its workers
     └── AgentError            names the agent (agent_id) and its generation
          ├── MailboxFull      a send found the mailbox full (block=False, or timed out)
          ├── StepTimeout      a step ran past its step_timeout
          ├── AgentStopped     a message to an agent that was stopped, finished or failed
          ├── AgentDeadlock    an agent's call would close a cycle of waiting agents
          └── DeadlineExceeded a call or an agent missed its deadline

Errors on the hot path are values (queue operations return EMPTY / RETRY);
exceptions appear only at the API boundary.  Raised by every part (client, worker, shared
structures, agents, journal) and re-exported by ``stealer``; of them this module imports
only the result status codes (stealer/shared/_layout.py).
"""

from __future__ import annotations

import pickle
from concurrent.futures import BrokenExecutor as _StdBrokenExecutor
from concurrent.futures.process import BrokenProcessPool as _StdBrokenProcessPool
from typing import Any

from stealer.shared._layout import ST_ERROR, ST_LOST

__all__ = [
    "StealerError",
    "BrokenExecutor",
    "WorkerCrashedError",
    "SerializationError",
    "ExecutorShutdownError",
    "AffinityError",
    "SharedMemoryFullError",
    "NotInTaskError",
    "RemoteError",
    "RemoteTraceback",
    "ClusterError",
    "NodeFencedError",
    "NodeLostError",
    "AgentError",
    "MailboxFull",
    "StepTimeout",
    "AgentStopped",
    "AgentDeadlock",
    "DeadlineExceeded",
]


class StealerError(Exception):
    """Base class of every exception stealer raises."""


class BrokenExecutor(StealerError, _StdBrokenExecutor):
    """The executor can no longer run tasks (an initializer failed, workers keep dying)."""


class WorkerCrashedError(BrokenExecutor, _StdBrokenProcessPool):
    """The worker process running this task died (os._exit, a signal, a segfault).

    Only the tasks that were running in that process fail; the executor
    starts a replacement and goes on.
    """


class SerializationError(StealerError, pickle.PicklingError):
    """A function, argument or result could not be pickled or unpickled."""


class ExecutorShutdownError(StealerError, RuntimeError):
    """The executor was shut down; no new work is accepted."""


class AffinityError(StealerError, ValueError):
    """A CPU pinning request cannot be honoured on this machine."""


class SharedMemoryFullError(StealerError, OSError):
    """The shared-memory directory has no room for an executor's segment."""


class NotInTaskError(StealerError, RuntimeError):
    """A task-only function (such as :func:`stealer.spawn`) was called outside a task."""


class RemoteError(StealerError):
    """A task raised an exception that could not be pickled back as itself."""


class ClusterError(StealerError, RuntimeError):
    """``Executor(cluster=...)`` cannot run on the cluster: Ray is not installed, the address
    does not answer, no alive node has a CPU, or a node executor failed to start.  The message
    says which and what to do."""


class NodeFencedError(ClusterError):
    """A node agent that heard nothing from its client for ``fence_s`` seconds stopped its
    workers and refuses work: the client re-runs that node's tasks elsewhere."""


class NodeLostError(WorkerCrashedError):
    """The cluster node that ran this task died (or fenced itself) more times than the
    executor's ``retries``; the task ran at least once per loss (at-least-once)."""


class RemoteTraceback(Exception):
    """Carries a worker-side traceback; chained as ``__cause__`` of re-raised errors."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class AgentError(StealerError):
    """Base of the agent errors; names the agent (its id) and its generation.

    They survive pickling (a worker raises them, the client re-raises them).
    """

    def __init__(self, message: str, agent_id: int = -1, generation: int = 0) -> None:
        super().__init__(message)
        self.agent_id = agent_id
        self.generation = generation

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.agent_id, self.generation))


class MailboxFull(AgentError):
    """The agent's mailbox is full (``send(..., block=False)``, or a send timed out)."""


class StepTimeout(AgentError):
    """An agent step ran longer than its ``step_timeout``."""


class AgentStopped(AgentError):
    """The agent was stopped, finished or failed: it takes no more messages."""


class AgentDeadlock(AgentError):
    """An agent's ``yield ref.call(...)`` would wait forever: the agent called is waiting,
    in a step or handler of its own, for this agent's reply (directly or through other
    agents' calls), and an agent handles messages only between its steps and handlers.
    Raised by ``ref.call`` inside the agent, before anything is sent; on a cluster, by the
    client that routes the call, at the caller's ``yield`` or ``await``."""


class DeadlineExceeded(AgentError):
    """A call or an agent missed its deadline."""


class AgentNotFound(AgentError, LookupError):
    """``Executor.agent(name)``: no agent of that name in the executor's journal."""


class JournalError(StealerError):
    """The agents' journal (``Executor(journal=PATH)``) cannot be used: not writable,
    held by another live executor, written by another version or user, not a journal,
    full disk, or state that does not pickle.  The message says which and what to do."""


def result_value(status: int, value: Any) -> tuple[int, Any]:
    """Normalise a stored outcome: an ST_LOST reason becomes an error payload."""
    if status == ST_LOST:
        reason = bytes(value).decode("utf-8", "replace") if value else "unknown"
        return ST_ERROR, (SerializationError(
            f"the worker could not store the task's result ({reason}); free space in "
            "/dev/shm or make the result smaller"), "")
    return status, value


def with_remote_tb(payload: Any) -> BaseException:
    """The exception of an (exception, traceback text) payload, the text chained as its cause."""
    exc, tb = payload
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    return exc
