"""stealer: run CPU-heavy Python work and agents on every core, with work stealing.

Public names only; each lives in its own module.
"""

from stealer.agents import Agent, AgentRef, Ctx
from stealer.errors import (
    AffinityError,
    AgentError,
    AgentStopped,
    BrokenExecutor,
    DeadlineExceeded,
    ExecutorShutdownError,
    MailboxFull,
    NotInTaskError,
    RemoteError,
    SerializationError,
    SharedMemoryFullError,
    StealerError,
    StepTimeout,
    WorkerCrashedError,
)
from stealer.executor import Executor
from stealer.forkjoin import Child, run_inline, spawn

__version__ = "0.1.0"

__all__ = [
    "AffinityError",
    "Agent",
    "AgentError",
    "AgentRef",
    "AgentStopped",
    "Ctx",
    "DeadlineExceeded",
    "MailboxFull",
    "StepTimeout",
    "BrokenExecutor",
    "Child",
    "Executor",
    "ExecutorShutdownError",
    "NotInTaskError",
    "RemoteError",
    "SerializationError",
    "SharedMemoryFullError",
    "StealerError",
    "WorkerCrashedError",
    "run_inline",
    "spawn",
]
