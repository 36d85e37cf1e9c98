"""Validated per-agent options (``Executor.spawn_agent(..., **options)``): :class:`AgentOptions`.

Built and checked on the client (stealer/client/executor.py, stealer/client/agents.py and
agents_batch.py), carried with the spawn, and read by the agents' host on the worker
(stealer/worker/agents/: host, entry, adopt, calls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from stealer.agents.api import TIERS

__all__ = ["AgentOptions", "DEFAULT_OPTIONS", "RESTARTS"]

RESTARTS = ("never", "on-failure")


@dataclass(frozen=True)
class AgentOptions:
    tier: int = 1
    mailbox: int = 64
    deadline: float | None = None  # seconds from spawn: EDF key; missed -> DeadlineExceeded
    step_timeout: float | None = None
    restart: str = "never"
    max_restarts: int = 3
    restart_window: float = 5.0
    checkpoint_every: int = 64  # steps + messages between in-memory checkpoints
    checkpoint_seconds: float = 1.0
    cpu_share: float | None = None  # fraction of one worker this agent may use before it is demoted

    @classmethod
    def parse(cls, options: dict[str, Any]) -> AgentOptions:
        opts = dict(options)
        tier = opts.pop("tier", "interactive")
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, not {tier!r}")
        kw: dict[str, Any] = {"tier": TIERS[tier]}
        mailbox = opts.pop("mailbox", 64)
        if not isinstance(mailbox, int) or isinstance(mailbox, bool) or not 1 <= mailbox < 1 << 31:
            raise ValueError(f"mailbox must be a positive int (messages), not {mailbox!r}")
        kw["mailbox"] = mailbox
        for name in ("deadline", "step_timeout", "cpu_share"):
            v = opts.pop(name, None)
            if v is not None:
                if (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0
                        or not math.isfinite(v)):
                    raise ValueError(f"{name} must be a positive number of seconds or None, "
                                     f"not {v!r}")
                if name == "cpu_share" and v > 1:
                    raise ValueError(f"cpu_share is a fraction of one worker (0 < share <= 1), "
                                     f"not {v!r}")
                kw[name] = float(v)
        restart = opts.pop("restart", "never")
        if restart not in RESTARTS:
            raise ValueError(f"restart must be one of {', '.join(map(repr, RESTARTS))}, "
                             f"not {restart!r}")
        kw["restart"] = restart
        for name, lo in (("max_restarts", 0), ("checkpoint_every", 1)):
            v = opts.pop(name, None)
            if v is not None:
                if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                    raise ValueError(f"{name} must be an int >= {lo}, not {v!r}")
                kw[name] = v
        for name in ("restart_window", "checkpoint_seconds"):
            v = opts.pop(name, None)
            if v is not None:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                    raise ValueError(f"{name} must be a positive number of seconds, not {v!r}")
                kw[name] = float(v)
        if opts:
            raise TypeError(f"spawn_agent() got unknown options: {', '.join(sorted(opts))} "
                            "(known: tier, mailbox, deadline, step_timeout, restart, "
                            "max_restarts, restart_window, checkpoint_every, checkpoint_seconds, "
                            "cpu_share, retries; the agent's own keyword arguments go in "
                            "init_kwargs={...})")
        return cls(**kw)

    checkpoint_ns: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint_ns", int(self.checkpoint_seconds * 1e9))

    def to_worker(self) -> tuple:
        return (self.tier, self.mailbox, self.deadline, self.step_timeout, self.restart,
                self.max_restarts, self.restart_window, self.checkpoint_every,
                self.checkpoint_seconds, self.cpu_share)

    @classmethod
    def from_worker(cls, t: tuple) -> AgentOptions:
        return cls(*t)


DEFAULT_OPTIONS = AgentOptions()
