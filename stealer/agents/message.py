"""An agent message's payload, one format for whoever writes it and whoever reads it.

A message record (``K_MSG``) holds one pickled tuple with the fields below, in this
order.  Senders write it with :func:`encode_message`: the client (client.py) and the
agents and tasks on a worker (calls.py).  The agent's owner reads it back
(``Arena.read_call``) with :func:`decode_message` (messages.py), or only its reply
slot with :func:`message_reply` (leaving.py, and client/agents.py when an agent is
abandoned).  ``AGENT_FID`` lives here too: the future id of an agent's final value,
which the client and the Host both write into agent records.
"""

from __future__ import annotations

from typing import Any

from stealer.shared import serialize

__all__ = ["AGENT_FID", "SET_STATE", "STATE", "agent_state", "decode_message", "encode_message",
           "message_chain", "message_reply", "set_agent_state"]

AGENT_FID = 1 << 63  # future ids of agents' final values: AGENT_FID | agent handle

# Two handlers every agent has, for whoever keeps its state outside its executor (the
# cluster executor's client, stealer/cluster/agents.py): STATE replies with the agent's
# state (``__getstate__()``, else its ``__dict__``), SET_STATE(state) puts one back
# (``__setstate__``, else ``__dict__.update``).  Named so no method can be (a NUL first).
STATE = "\x00state"
SET_STATE = "\x00set_state"


def agent_state(obj: Any) -> Any:
    """What STATE replies: the state pickle would save of ``obj``."""
    get = getattr(obj, "__getstate__", None)
    return get() if get is not None else obj.__dict__


def set_agent_state(obj: Any, state: Any) -> None:
    """SET_STATE's handler: ``state`` (from :func:`agent_state`) put back into ``obj``."""
    put = getattr(obj, "__setstate__", None)
    if put is not None:
        put(state)
    elif state is not None:
        obj.__dict__.update(state)

# the payload's fields by position: the agent it is for, the handler, its arguments, the
# reply slot (-1: a one-way send), the deadline (monotonic seconds or None), and for a
# journaled executor the sender's id, its seq and its ack (see encode_message); then, only
# in a call made by an agent's generator that itself serves a call from an agent, the
# calls' chain above that agent (CHAIN: see encode_message; decode_message leaves it out)
TARGET, METHOD, ARGS, KWARGS, REPLY, DEADLINE, SENDER, SEQ, ACK, CHAIN = range(10)
FIELDS = 9


def encode_message(target: int, method: str, args: tuple, kwargs: dict | None, reply: int,
                   deadline: float | None, sender: str | None = None,
                   seq: int = 0, ack: int = 0, chain: tuple = ()) -> tuple[bytes, list]:
    """A message record's payload.  ``sender``/``seq`` (journaled executors only) name it
    for the receiver's deduplication (see the journal package, stealer/agents/journal/); ``ack``: the sender's messages up to
    this seq are covered by its latest checkpoint (the receiver forgets their replies).

    ``chain``: the handles of the agents waiting, each in a generator, for the reply to the
    call the sending agent's generator serves, outermost first (the sender itself is not
    in it: the callee reads it from the reply slot's link, K_REPLY).  Only a non-empty
    chain is written (a tenth field), so a call at depth one keeps the nine fields that
    the native turn serves (HotPath.serve); the callee refuses a call back into the chain
    (Calls.call, errors.AgentDeadlock)."""
    if not method_ok(method):
        raise ValueError(f"a message names a public method of the agent, not {method!r}")
    if chain:
        return serialize.dumps((target, method, args, kwargs or None, reply, deadline, sender,
                                seq, ack, chain), f"message {method!r}")
    return serialize.dumps((target, method, args, kwargs or None, reply, deadline, sender, seq,
                            ack), f"message {method!r}")


def method_ok(method: Any) -> bool:
    """Whether a message may name ``method``: a public method's name."""
    return isinstance(method, str) and bool(method) and not method.startswith("_")


def decode_message(msg: Any) -> tuple:
    """``(target, method, args, kwargs, reply, deadline, sender, seq, ack)`` of a payload
    read back.  One without ``ack`` (8 fields: a journal may hold such older messages)
    reads with ack 0, nothing acked.  Raises for anything that is not a payload."""
    n = len(msg)
    if n == FIELDS:
        return msg
    return msg[:FIELDS] if n > FIELDS else (*msg, 0)


def message_chain(msg: Any) -> tuple:
    """The chain of a payload read back (see :func:`encode_message`; () when it has none)."""
    return msg[CHAIN] if len(msg) > CHAIN else ()


def message_reply(msg: Any) -> int:
    """The reply slot of a payload read back (-1: a one-way send)."""
    return msg[REPLY]
