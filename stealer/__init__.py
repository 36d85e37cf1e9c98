"""stealer: run CPU-heavy Python work and agents on every core, with work stealing.

Public names only; each lives in its own module.
"""

from stealer.agents import Agent, AgentRef, Ctx
from stealer.errors import (
    AffinityError,
    AgentError,
    AgentNotFound,
    AgentStopped,
    BrokenExecutor,
    DeadlineExceeded,
    ExecutorShutdownError,
    JournalError,
    MailboxFull,
    NotInTaskError,
    RemoteError,
    SerializationError,
    SharedMemoryFullError,
    StealerError,
    StepTimeout,
    WorkerCrashedError,
)
from stealer.executor import Executor, recover
from stealer.forkjoin import Child, run_inline, spawn

__version__ = "0.1.0"

__all__ = [
    "AffinityError",
    "Agent",
    "AgentError",
    "AgentNotFound",
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
    "JournalError",
    "NotInTaskError",
    "RemoteError",
    "SerializationError",
    "SharedMemoryFullError",
    "StealerError",
    "WorkerCrashedError",
    "recover",
    "run_inline",
    "spawn",
]
