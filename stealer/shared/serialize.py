"""Serialization: stdlib pickle first, cloudpickle when that fails (or when ``__main__``
is no file other processes can import: :func:`main_by_value`), protocol 5.

Out-of-band buffers (numpy arrays and anything exposing ``PickleBuffer``, larger
than :data:`INBAND_MAX` bytes: smaller ones stay in the pickle) are written straight
into shared memory by the arena, after a small frame
header; the reader copies each buffer once into a private ``bytearray`` so
the object it gets owns its memory (the shared block is recycled at once).

Frame of a payload with buffers (the record's F_BUFFERS bit is set)::

    u32 nbuf | u32 0 | u64 pickle_len | u64 len[nbuf] | pickle | buf0 | buf1 ...

Without buffers the payload is the pickle bytes alone.

Small payloads skip pickle: a call of a function with an id whose positional arguments
are all ``None``, ``bool``, ``int`` (64-bit), ``float``, or ``str``/``bytes`` of at most 255
bytes, and a result of one such value, are written in the small format (below) by the
client's and the worker's native paths; every reader takes both (:func:`load_value`,
:func:`load_call`).  A pickle starts with PROTO (0x80), a small payload with :data:`SMALL`::

    value:  u8 tag | body        tags: None 0, False 1, True 2, int 3 (i64), float 4 (f64),
                                       str 5 (u8 len, UTF-8), bytes 6 (u8 len, bytes)
    result: SMALL | value
    call:   SMALL | u32 function id | u8 nargs | value * nargs      (no keyword arguments)

Small numpy arrays (C-contiguous, plain dtype, at most :data:`INBAND_MAX` bytes) in a
payload's first two levels (the value, or the items of a tuple or list, or of one inside
it: a call's arguments, a reply ``(obs, reward)``) pickle as their bytes, dtype and shape,
read back by :func:`_small_array`: numpy's own reduction costs about 5 µs to write and
3.5 µs to read a 2-element array, this one about half of that (the lockstep agents
benchmark sends one each way per call).  numpy is never imported here: the check looks
for it among the loaded modules.

Before any Pickler, :func:`dumps` tries the native writer of small pickles
(native/_fastpickle.pyx, ``stealer._fastpickle``): None, bool, 64-bit int, float, str,
bytes, tuples, lists and dicts of them and such small arrays, at most 4 KiB, written as
the opcodes of a protocol-5 pickle (arrays as the same ``_small_array`` call), so every
reader is ``pickle.loads`` as before; anything else (a subclass, a shared or cyclic
object, a bigger payload) it refuses and pickle writes it.

Functions are sent once: :class:`FunctionTable` writes a function's pickle
into the segment's function area and tasks then carry its integer id.
Only plain functions and builtins are cached this way; bound methods,
partials and other callables carry state and travel with every task.

Used wherever a payload is written or read: the client (stealer/client/executor.py's
submit, pool.py's results, the agents' client), the worker (loop.py, join.py, outcome.py,
the agents' host), the arena (frames in blocks) and the agents' messages and journal blobs
(stealer/agents/message.py, jblob.py).
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import struct
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import cloudpickle

from stealer.errors import SerializationError

__all__ = ["INBAND_MAX", "keep_large", "dumps", "frame_size", "frame_header", "write_frame", "loads_frame", "FunctionTable",
           "ErrorPayload", "SMALL", "encode_small", "encode_small_call", "load_value",
           "load_call", "dump_result"]

_HDR = struct.Struct("=IIQ")
_LEN = struct.Struct("=Q")
_PROTO = 5


# A buffer of at most this many bytes is pickled in-band: framing it apart costs more
# than its copy (a reply of 64 floats took the frame path: header, lengths, a block of its
# own and a second copy on the reader's side), and a payload without buffers can take the
# native paths.  native/_cqueues.pyx's _refuse_buffers applies the same rule.
INBAND_MAX = 2048


def keep_large(bufs: list) -> Callable[[pickle.PickleBuffer], bool | None]:
    """A pickle ``buffer_callback`` that keeps the buffers larger than :data:`INBAND_MAX`
    out-of-band (appended to ``bufs``) and the others in the pickle."""

    def oob(b: pickle.PickleBuffer) -> bool | None:
        # true: in-band; None: out-of-band (pickle's buffer_callback contract)
        return memoryview(b).nbytes <= INBAND_MAX or bufs.append(b)

    return oob


_ndarray: Any = None  # numpy.ndarray, once numpy is loaded (by the user: never here)
_PLAIN_KINDS = frozenset("biufc")  # bool, ints, floats, complex: their dtype.str says all
_SCAN_MAX = 32  # items of a tuple or list looked at for arrays (a long one: pickle's way)


def _small_array(data: bytes, dtype: str, shape: tuple) -> Any:
    """An array written by :class:`_ArrayPickler` (writable, owning its memory)."""
    np = sys.modules["numpy"]  # the writer's pickle names this function: numpy is loaded
    # one constructor call (frombuffer + reshape took 1.4 µs, this 0.9)
    return np.ndarray(shape, dtype, bytearray(data))


# _small_array pickles as a 2-byte extension code instead of its module and name (38 bytes):
# a message with a small array then fits a record's inline area (arena.INLINE, 96 bytes) and
# takes the native call path.  A code from copyreg's private-use range (240-255, PEP 307);
# both sides register it at import.  Taken by someone else: the pickle names the global.
_SMALL_ARRAY_CODE = 0xF5
try:
    copyreg.add_extension(__name__, "_small_array", _SMALL_ARRAY_CODE)
except ValueError:
    pass

# The native writer of small pickles (native/_fastpickle.pyx): a call's message, a reply
# (obs, reward), a tuple of numbers written in 0.4-0.9 µs instead of 3-6 through a Pickler.
# It writes arrays under the extension code above, so only where that code is ours; not
# with STEALER_NO_EXTENSIONS (the reference build), nor where it was not built.
_fast: Callable[[Any], bytes | None] | None = None
fast_loads: Callable[[Any], Any] = pickle.loads  # pickle.loads, or its native twin below
if (os.environ.get("STEALER_NO_EXTENSIONS", "") in ("", "0")
        and copyreg._extension_registry.get((__name__, "_small_array")) == _SMALL_ARRAY_CODE):
    try:
        from stealer import _fastpickle
    except ImportError:  # not built: pickle's way (queues.py says so once)
        pass
    else:
        if _fastpickle.EXT == _SMALL_ARRAY_CODE and _fastpickle.ARRAY_MAX == INBAND_MAX:
            _fast = _fastpickle.dumps
            # and its reader: what it writes, read back without an Unpickler (anything
            # else by pickle.loads); the native inline reads use it too
            _fastpickle.set_loads(pickle.loads)
            fast_loads = _fastpickle.loads
            try:
                from stealer import _cqueues
            except ImportError:
                pass
            else:
                _cqueues.set_loads(fast_loads)


class _ArrayPickler(pickle.Pickler):
    """A pickler that writes small plain arrays as (bytes, dtype, shape)."""

    def reducer_override(self, obj: Any) -> Any:
        if (type(obj) is _ndarray and obj.nbytes <= INBAND_MAX and obj.flags.c_contiguous
                and obj.dtype.kind in _PLAIN_KINDS):
            return _small_array, (obj.tobytes(), obj.dtype.str, obj.shape)
        return NotImplemented


# The same pickler with the native reducer (_fastpickle.reduce_array, the twin of the
# method above: 0.1-0.2 µs an array instead of 0.66), where the fast writer is on.
_Pickler: type[pickle.Pickler] = _ArrayPickler
if _fast is not None and hasattr(_fastpickle, "reduce_array"):
    _fastpickle.set_small_array(_small_array)

    class _NativeArrayPickler(pickle.Pickler):
        reducer_override = _fastpickle.reduce_array  # (a method: Cython functions bind)

    _Pickler = _NativeArrayPickler


def _has_arrays(obj: Any) -> bool:
    """Is there an ndarray in ``obj``'s first two levels (short tuples and lists)?"""
    if not _numpy_loaded():
        return False
    nd = _ndarray
    t = type(obj)
    if t is nd:
        return True
    if (t is tuple or t is list) and len(obj) <= _SCAN_MAX:
        for x in obj:
            tx = type(x)
            if tx is nd:
                return True
            if (tx is tuple or tx is list) and len(x) <= _SCAN_MAX:
                for y in x:
                    if type(y) is nd:
                        return True
    return False


def _numpy_loaded() -> bool:
    """Is numpy imported (then known to the array pickler)?"""
    if _ndarray is not None:
        return True
    np = sys.modules.get("numpy")
    if np is None:
        return False
    _found_numpy(np)
    return True


def _found_numpy(np: Any) -> Any:
    global _ndarray
    _ndarray = np.ndarray
    if _fast is not None:
        _fastpickle.set_ndarray(_ndarray)
    return _ndarray


def main_by_value() -> bool:
    """Is ``__main__`` a module other processes cannot import by its name (``python -c``,
    a REPL, a notebook: it has no ``__file__``)?  stdlib pickle writes what it defines by
    name all the same, and a worker then fails to find it (``Can't get attribute 'P' on
    <module '__main__'>``), so :func:`dumps` goes to cloudpickle, which writes it by
    value.  (A script's ``__main__`` has a file: a worker imports it as ``__mp_main__``.)"""
    main = sys.modules.get("__main__")
    return main is not None and getattr(main, "__file__", None) is None


def refuse_dumps(*args: Any, **kwargs: Any) -> bytes:
    """A ``pickle.dumps`` stand-in for a fast path that tries stdlib pickle first, where
    :func:`main_by_value`: it refuses, so that path takes :func:`dumps` (cloudpickle)."""
    raise pickle.PicklingError("__main__ cannot be imported by the workers: by value")


def dumps(obj: Any, what: str = "object", fast: bool = True,
          arrays: bool = False) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj``; returns the pickle and its out-of-band buffers (those larger than
    :data:`INBAND_MAX` bytes).  ``fast`` False: the native writer already refused it.
    ``arrays``: small arrays may lie anywhere in it (an agent's state), not only in its
    first two levels: the array pickler is used whenever numpy is loaded."""
    if fast and _fast is not None:
        if _ndarray is None:  # (the writer learns numpy.ndarray once it is loaded)
            _numpy_loaded()
        data = _fast(obj)
        if data is not None:
            return data, []
    bufs: list[pickle.PickleBuffer] = []
    oob = keep_large(bufs)
    if not main_by_value():  # (else cloudpickle below: __main__'s classes by value)
        try:
            if (arrays and _numpy_loaded()) or _has_arrays(obj):
                f = io.BytesIO()
                _Pickler(f, _PROTO, buffer_callback=oob).dump(obj)
                return f.getvalue(), bufs
            return pickle.dumps(obj, _PROTO, buffer_callback=oob), bufs
        except Exception:
            bufs.clear()
    try:
        return cloudpickle.dumps(obj, _PROTO, buffer_callback=oob), bufs
    except Exception as exc:
        raise SerializationError(
            f"could not pickle the {what} ({type(exc).__name__}: {exc}). Tasks, their "
            "arguments and results must be picklable (stealer uses cloudpickle, so lambdas "
            "and closures work; open files, locks, sockets and generators do not)."
        ) from exc


SMALL = 0x01  # first byte of a small payload (a pickle's is PROTO, 0x80)
_V_NONE, _V_FALSE, _V_TRUE, _V_INT, _V_FLOAT, _V_STR, _V_BYTES = range(7)
_I64 = struct.Struct("=q")  # host order: the native side copies the words as they are
_F64 = struct.Struct("=d")
_CALL = struct.Struct("=BIB")
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


def _small_value(v: Any) -> bytes | None:
    t = type(v)
    if v is None:
        return b"\x00"
    if t is bool:
        return b"\x02" if v else b"\x01"
    if t is int:
        return b"\x03" + _I64.pack(v) if _INT_MIN <= v <= _INT_MAX else None
    if t is float:
        return b"\x04" + _F64.pack(v)
    if t is str:
        try:
            b = v.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: pickle keeps them
            return None
        return b"\x05" + bytes((len(b),)) + b if len(b) <= 255 else None
    if t is bytes:
        return b"\x06" + bytes((len(v),)) + v if len(v) <= 255 else None
    return None


def encode_small(value: Any) -> bytes | None:
    """The small format of a result, or None when ``value`` has none (reference of the
    native ``dump_result``'s first step)."""
    b = _small_value(value)
    return None if b is None else b"\x01" + b


def encode_small_call(fref: int, args: tuple, limit: int = 1 << 30) -> bytes | None:
    """The small format of a call ``(fref, args, None)``, or None when it has none or is
    longer than ``limit`` bytes (reference of the native submit's encoder)."""
    if type(fref) is not int or not 0 <= fref < 1 << 32 or len(args) > 255:
        return None
    parts = [_CALL.pack(SMALL, fref, len(args))]
    for a in args:
        b = _small_value(a)
        if b is None:
            return None
        parts.append(b)
    out = b"".join(parts)
    return out if len(out) <= limit else None


class _HasBuffers(Exception):
    pass


def _in_band_only(buf: Any) -> bool:
    if memoryview(buf).nbytes <= INBAND_MAX:
        return True  # small: in the pickle, as dumps() keeps it
    raise _HasBuffers  # stop at the first out-of-band buffer, before it is copied


def dump_result(value: Any) -> bytes:
    """A plain result's payload: the small format, else an in-band pickle; raises at the
    first out-of-band buffer (the caller then keeps the buffers apart, see
    :func:`dumps`).  Reference of the native ``dump_result``."""
    return encode_small(value) or pickle.dumps(value, _PROTO, buffer_callback=_in_band_only)


def _read_value(mv: memoryview, p: int) -> tuple[Any, int]:
    tag = mv[p]
    if tag == _V_NONE:
        return None, p + 1
    if tag in (_V_FALSE, _V_TRUE):
        return tag == _V_TRUE, p + 1
    if tag == _V_INT:
        return _I64.unpack_from(mv, p + 1)[0], p + 9
    if tag == _V_FLOAT:
        return _F64.unpack_from(mv, p + 1)[0], p + 9
    if tag in (_V_STR, _V_BYTES):
        n = mv[p + 1]
        if p + 2 + n > len(mv):
            raise ValueError("corrupt small payload: a string runs past its end")
        b = bytes(mv[p + 2 : p + 2 + n])
        return (b.decode("utf-8") if tag == _V_STR else b), p + 2 + n
    raise ValueError(f"corrupt small payload: unknown tag {tag}")


def load_value(src: Any) -> Any:
    """A result payload without buffers: the small format or a pickle."""
    if not len(src) or src[0] != SMALL:
        return pickle.loads(src)
    mv = memoryview(src)
    try:
        v, p = _read_value(mv, 1)
    except (IndexError, struct.error) as exc:
        raise ValueError("corrupt small payload: truncated") from exc
    if p != len(mv):
        raise ValueError("corrupt small payload: bytes after its value")
    return v


def load_call(src: Any) -> tuple:
    """A call payload without buffers, ``(fref, args, kwargs)``: small format or pickle."""
    if not len(src) or src[0] != SMALL:
        return pickle.loads(src)
    mv = memoryview(src)
    try:
        _tag, fref, n = _CALL.unpack_from(mv, 0)
        p = _CALL.size
        args = []
        for _ in range(n):
            v, p = _read_value(mv, p)
            args.append(v)
    except (IndexError, struct.error) as exc:
        raise ValueError("corrupt small payload: truncated") from exc
    if p != len(mv):
        raise ValueError("corrupt small payload: bytes after its arguments")
    return fref, tuple(args), None


def frame_size(data: bytes, bufs: list[pickle.PickleBuffer]) -> int:
    if not bufs:
        return len(data)
    return _HDR.size + _LEN.size * len(bufs) + len(data) + sum(b.raw().nbytes for b in bufs)


def frame_header(data: bytes, bufs: list[pickle.PickleBuffer]) -> bytes:
    """The bytes of a frame before its pickle: header and buffer lengths (bufs not empty)."""
    lens = [b.raw().nbytes for b in bufs]
    return _HDR.pack(len(lens), 0, len(data)) + struct.pack(f"={len(lens)}Q", *lens)


def write_frame(dst: Any, off: int, data: bytes, bufs: list[pickle.PickleBuffer]) -> None:
    """Write a payload at ``dst[off:]`` (``dst`` is an mmap or writable buffer)."""
    if not bufs:
        dst[off : off + len(data)] = data
        return
    raws = [b.raw() for b in bufs]
    _HDR.pack_into(dst, off, len(raws), 0, len(data))
    p = off + _HDR.size
    for r in raws:
        _LEN.pack_into(dst, p, r.nbytes)
        p += _LEN.size
    dst[p : p + len(data)] = data
    p += len(data)
    for r in raws:
        dst[p : p + r.nbytes] = r
        p += r.nbytes


def loads_frame(src: Any, has_buffers: bool) -> Any:
    """Unpickle a payload written by :func:`write_frame` (``src`` is bytes-like)."""
    if not has_buffers:
        return load_value(src)
    mv = memoryview(src)
    nbuf, _, plen = _HDR.unpack_from(mv, 0)
    p = _HDR.size
    lens = [_LEN.unpack_from(mv, p + _LEN.size * i)[0] for i in range(nbuf)]
    p += _LEN.size * nbuf
    data = mv[p : p + plen]
    p += plen
    buffers = []
    for n in lens:
        buffers.append(bytearray(mv[p : p + n]))
        p += n
    return pickle.loads(data, buffers=buffers)


class ErrorPayload(tuple):
    """``(exception, worker traceback text)`` of a failed task; unpickles to a plain tuple.

    In the worker it is that tuple.  Pickled, it always unpickles, into the
    original exception when it can be rebuilt and into a useful stand-in
    when it cannot, so the client always gets an exception to chain the
    worker's traceback to.  The ways an exception resists:

    * its ``__init__`` needs arguments that ``args`` does not hold
      (``def __init__(self, a, b): super().__init__(f"{a}-{b}")``): pickle
      writes it but cannot rebuild it.  It is rebuilt without ``__init__``
      (``cls.__new__`` plus ``args`` and ``__dict__``): the same type, text
      and attributes;
    * it does not pickle at all (it holds a lock), or its class cannot be
      imported where it is unpickled: a :class:`~stealer.errors.RemoteError`
      naming the type and the text;
    * its ``__str__`` raises: the text says so instead.
    """

    __slots__ = ()

    def __new__(cls, exc: BaseException, tb: str) -> ErrorPayload:
        return super().__new__(cls, (exc, tb))

    def __reduce__(self) -> tuple:
        exc, tb = self
        name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        text = safe_str(exc)
        why = ""
        try:
            data = _dumps_inband(exc)
            rebuilt = pickle.loads(data)  # can it be rebuilt? (an __init__ with arguments cannot)
            if isinstance(rebuilt, BaseException):
                return _load_error, (data, False, name, text, "", tb)
        except Exception as e:
            why = f"{type(e).__name__}: {safe_str(e)}"
        try:
            state = getattr(exc, "__dict__", None) or None
            data = _dumps_inband((type(exc), exc.args, state))
            return _load_error, (data, True, name, text, why, tb)
        except Exception as e:
            why = f"{type(e).__name__}: {safe_str(e)}"
        return _load_error, (None, False, name, text, why, tb)


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a note that it failed (an exception's ``__str__`` may raise)."""
    try:
        return str(exc)
    except Exception as e:
        return f"<str() of the exception failed: {type(e).__name__}>"


def _dumps_inband(obj: Any) -> bytes:
    if not main_by_value():  # (else cloudpickle: see main_by_value)
        try:
            return pickle.dumps(obj, _PROTO)
        except Exception:
            pass
    return cloudpickle.dumps(obj, _PROTO)


def _load_error(data: bytes | None, raw: bool, name: str, text: str, why: str,
                tb: str) -> tuple[BaseException, str]:
    """Unpickler of :class:`ErrorPayload`: ``(exception, traceback)``; never raises."""
    if data is not None:
        try:
            obj = pickle.loads(data)
            if raw:
                cls, args, state = obj
                exc = cls.__new__(cls, *args)  # BaseException.__new__; __init__ is not called
                exc.args = args
                if state:
                    exc.__dict__.update(state)
            else:
                exc = obj
            if isinstance(exc, BaseException):
                return exc, tb
            why = f"it unpickled to a {type(exc).__name__}"
        except Exception as e:
            why = f"{type(e).__name__}: {safe_str(e)}"
    from stealer.errors import RemoteError

    return RemoteError(f"{name}: {text} (the original exception could not be sent back: "
                       f"{why or 'unknown reason'})"), tb


def cacheable(fn: Any) -> bool:
    """Functions whose pickle does not change between calls (no bound state).

    Plain Python functions, classes (agent classes: a spawn then names its
    class by id, so it fits a record's inline bytes), and builtins of a
    module (``math.sqrt``); not builtin methods bound to an object
    (``some_list.append``), whose ``__self__`` would be frozen at the first
    submit.
    """
    t = type(fn)
    if t is types.FunctionType or isinstance(fn, type):
        return True
    if t is types.BuiltinFunctionType:
        owner = getattr(fn, "__self__", None)
        return owner is None or isinstance(owner, types.ModuleType)
    return False


class FunctionTable:
    """Function pickles stored once in the segment, referenced by id.

    Writer: the client only (under ``self._lock``).  Readers: workers, which
    look an id up the first time they meet it and keep the function.
    Entry i is (offset u64, length u64) at ``table_off + 16 i``; the length
    is stored last with release (store64), so a reader that sees a non-zero
    length (load64 acquire) sees the bytes.  The client writes an entry
    before it submits any task that names the id, and the injector push
    (release) orders the two anyway.
    """

    def __init__(self, mm: Any, region: Any, table_off: int, entries: int, data_off: int,
                 data_size: int) -> None:
        self.mm = mm
        self.region = region
        self.table_off = table_off
        self.entries = entries
        self.data_off = data_off
        self.data_size = data_size
        self._ids: dict[Any, int] = {}  # client side: function -> id
        self._fns: dict[int, Any] = {}  # worker side: id -> function
        self._count = 0
        self._used = 0
        self._lock = threading.Lock()

    def id_of(self, fn: Any) -> int:
        """Client: the id of ``fn``, registering it on first use; -1 when not cacheable."""
        try:
            return self._ids[fn]
        except KeyError:
            pass
        except TypeError:
            return -1
        if not cacheable(fn):
            return -1
        with self._lock:
            if fn in self._ids:
                return self._ids[fn]
            data, bufs = dumps(fn, "function")
            if bufs or self._count >= self.entries or self._used + len(data) > self.data_size:
                return -1
            off = self.data_off + self._used
            self.mm[off : off + len(data)] = data
            ent = self.table_off + 16 * self._count
            self.region.store64(ent, off)          # entry offset; published by the length store below
            self.region.store64(ent + 8, len(data))  # release: pairs with load64 in get()
            fid = self._count
            self._count += 1
            self._used += len(data)
            self._ids[fn] = fid
            return fid

    def get(self, fid: int) -> Any:
        """Worker: the function registered under ``fid``."""
        try:
            return self._fns[fid]
        except KeyError:
            pass
        if not 0 <= fid < self.entries:
            raise SerializationError(f"unknown function id {fid}")
        ent = self.table_off + 16 * fid
        n = self.region.load64(ent + 8)  # acquire: pairs with the client's store64 of the length
        if n == 0:
            raise SerializationError(f"function id {fid} is not registered")
        off = self.region.load64(ent)
        try:
            fn = pickle.loads(self.mm[off : off + n])
        except Exception as exc:
            main = "__main__" in str(exc) or "__mp_main__" in str(exc)
            raise SerializationError(
                f"could not unpickle the task function or agent class in the worker "
                f"({type(exc).__name__}: {exc}). "
                + ("A worker imports your script, not what runs under its `if __name__ == "
                   "'__main__':`: define functions and classes at the script's top level "
                   "(or in a module)." if main else
                   "If it is defined in a module, that module must be importable in the "
                   "worker processes.")
            ) from exc
        self._fns[fid] = fn
        try:
            self._ids[fn] = fid
        except TypeError:
            pass
        return fn

    def id_known(self, fn: Any) -> int:
        """Worker: the id of a function already loaded from the table, else -1."""
        try:
            return self._ids.get(fn, -1)
        except TypeError:
            return -1
