"""The journal's blobs and keys, without SQLite (journal/store.py has the store): what a
worker imports on its hot path stays light when no journal is used.  Used by the agents'
client (stealer/client/agents.py) and host (stealer/worker/agents/: calls, messages,
leaving) to pack what they log, and by the journal (stealer/agents/journal/)."""

from __future__ import annotations

import pickle
import struct
from typing import Any

from stealer.shared import serialize

__all__ = ["pack", "unpack", "loads", "sender_is_agent"]

_HDR = struct.Struct("=IIQ")
_LEN = struct.Struct("=Q")


def sender_is_agent(key: str | None) -> bool:
    """Agents' uids start with a digit; the client's keys with 'c', plain tasks' with 't'."""
    return bool(key) and key[0].isdigit()


def pack(pair: tuple[bytes, list]) -> tuple[bytes, int]:
    """(blob, oob) of a (pickle, buffers) pair from serialize.dumps."""
    data, bufs = pair
    if not bufs:
        return bytes(data), 0
    out = bytearray(serialize.frame_size(data, bufs))
    serialize.write_frame(out, 0, data, bufs)
    return bytes(out), 1


def unpack(blob: bytes, oob: int) -> tuple[bytes, list]:
    """The (pickle, buffers) pair :meth:`Arena.put` takes."""
    if not oob:
        return blob, []
    mv = memoryview(blob)
    nbuf, _, plen = _HDR.unpack_from(mv, 0)
    p = _HDR.size
    lens = [_LEN.unpack_from(mv, p + _LEN.size * i)[0] for i in range(nbuf)]
    p += _LEN.size * nbuf
    data = bytes(mv[p : p + plen])
    p += plen
    bufs = []
    for n in lens:
        bufs.append(pickle.PickleBuffer(bytearray(mv[p : p + n])))
        p += n
    return data, bufs


def loads(blob: bytes, oob: int) -> Any:
    return serialize.loads_frame(blob, bool(oob))
