# cython: language_level=3
"""Small pickles written directly, without a Pickler: the payloads of agent calls and their
replies (a method name, a tuple of a few numbers and small numpy arrays, a reply handle).

``dumps(obj, ndarray)`` returns the bytes of a protocol-5 pickle of ``obj`` that
``pickle.loads`` reads back equal to ``obj``, or None when ``obj`` is not one of the
shapes below (the caller then pickles it the usual way, stealer/shared/serialize.py):

* None, bool, int (64-bit), float, str (UTF-8 encodable), bytes: the opcodes pickle
  itself writes for them;
* tuple, list, dict of those, nested at most ``MAXDEPTH`` levels, ``MAXITEMS`` items in all;
* a numpy array of exactly type ``ndarray`` (no subclass), C-contiguous, of a plain kind
  (bool, ints, floats, complex) and at most ``ARRAY_MAX`` bytes: written as the call
  ``_small_array(data, dtype.str, shape)`` under the copyreg extension code ``EXT``
  (serialize.py registers both, and reads it back as a writable array owning its memory);
* at most ``CAP`` bytes in all.

A list, dict or array met twice (shared, or a cycle) makes it refuse: pickle would keep
them one object, and this writer keeps no memo.  Only exact types are written (a subclass
of int, a numpy scalar... is refused), so nothing's ``__reduce__`` is skipped.

Cost on the 2-core VM: 0.4-0.6 µs for ``(obs, reward)`` of an 8-float array and a float,
against 4.6 µs through serialize's array pickler; a call's message tuple likewise.
tests/test_fastpickle.py checks every shape against ``pickle.loads`` (hypothesis) and the
refusals.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

cdef extern from "Python.h":
    void PyErr_Clear()
    # declared here without Cython's ``except NULL``: NULL (lone surrogates) is a refusal
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size)

DEF CAP = 4096       # bytes written at most (a buffer on the C stack)
DEF MAXDEPTH = 4     # containers nested at most this deep
DEF MAXITEMS = 256   # items (values and containers) in all
DEF MAXSEEN = 64     # mutable objects (lists, dicts, arrays) in all

ARRAY_MAX = 2048     # serialize.INBAND_MAX: a larger array goes out of band, by pickle
EXT = 0xF5           # serialize._SMALL_ARRAY_CODE

cdef struct Out:
    char buf[CAP]
    Py_ssize_t n
    int items
    int nseen
    void *seen[MAXSEEN]


cdef inline bint _room(Out *o, Py_ssize_t k):
    return o.n + k <= CAP


cdef inline void _byte(Out *o, unsigned char c):
    o.buf[o.n] = <char>c
    o.n += 1


cdef inline bint _op(Out *o, unsigned char c):
    """One opcode, if there is room."""
    if o.n >= CAP:
        return False
    _byte(o, c)
    return True


cdef bint _items(Out *o, object x, Py_ssize_t n, int depth):
    """The ``n`` items of tuple or list ``x``, one level down."""
    cdef Py_ssize_t i
    for i in range(n):
        if not _value(o, x[i], depth - 1):
            return False
    return True


cdef inline void _le(Out *o, uint64_t v, int k):
    cdef int i
    for i in range(k):
        o.buf[o.n + i] = <char>((v >> (8 * i)) & 0xFF)
    o.n += k


cdef inline bint _remember(Out *o, object x):
    """False if ``x`` was met before (or too many were): the writer refuses."""
    cdef void *p = <void *>x
    cdef int i
    for i in range(o.nseen):
        if o.seen[i] == p:
            return False
    if o.nseen >= MAXSEEN:
        return False
    o.seen[o.nseen] = p
    o.nseen += 1
    return True


cdef bint _blob(Out *o, const char *data, Py_ssize_t n, unsigned char short_op,
                unsigned char long_op):
    """SHORT_BINBYTES/BINBYTES or SHORT_BINUNICODE/BINUNICODE with ``n`` bytes."""
    if n < 256:
        if not _room(o, 2 + n):
            return False
        _byte(o, short_op)
        _byte(o, <unsigned char>n)
    else:
        if not _room(o, 5 + n):
            return False
        _byte(o, long_op)
        _le(o, <uint64_t>n, 4)
    memcpy(o.buf + o.n, data, n)
    o.n += n
    return True


cdef bint _int(Out *o, object x):
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(x, &overflow)
    if overflow:
        return False
    if not _room(o, 10):
        return False
    if 0 <= v < 256:
        _byte(o, 0x4B)  # BININT1
        _byte(o, <unsigned char>v)
    elif 0 <= v < 65536:
        _byte(o, 0x4D)  # BININT2
        _le(o, <uint64_t>v, 2)
    elif -2147483648 <= v < 2147483648:
        _byte(o, 0x4A)  # BININT: 4 bytes, signed
        _le(o, <uint64_t>v, 4)
    else:
        _byte(o, 0x8A)  # LONG1: 8 bytes, little-endian two's complement
        _byte(o, 8)
        _le(o, <uint64_t>v, 8)
    return True


cdef bint _float(Out *o, double d):
    cdef uint64_t bits
    cdef int i
    if not _room(o, 9):
        return False
    memcpy(&bits, &d, 8)
    _byte(o, 0x47)  # BINFLOAT: 8 bytes, big-endian
    for i in range(8):
        o.buf[o.n + i] = <char>((bits >> (8 * (7 - i))) & 0xFF)
    o.n += 8
    return True


cdef bint _array(Out *o, object x):
    """``_small_array(data, dtype.str, shape)`` under the extension code."""
    if not _remember(o, x):
        return False
    if x.nbytes > ARRAY_MAX or not x.flags.c_contiguous:
        return False
    dt = x.dtype
    kind = dt.kind
    if kind not in ("b", "i", "u", "f", "c"):
        return False
    data = x.tobytes()
    if not _room(o, 2):
        return False
    _byte(o, 0x82)  # EXT1
    _byte(o, EXT)
    if not _blob(o, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), 0x43, 0x42):
        return False
    if not _value(o, dt.str, MAXDEPTH - 1):
        return False
    if not _value(o, x.shape, MAXDEPTH - 1):
        return False
    if not _room(o, 2):
        return False
    _byte(o, 0x87)  # TUPLE3: the arguments
    _byte(o, 0x52)  # REDUCE
    return True


cdef bint _value(Out *o, object x, int depth):
    cdef Py_ssize_t n, pos
    cdef const char *s
    cdef PyObject *k
    cdef PyObject *v
    o.items += 1
    if o.items > MAXITEMS:
        return False
    t = type(x)
    if x is None:
        return _op(o, 0x4E)  # NONE
    if t is bool:
        return _op(o, 0x88 if x else 0x89)  # NEWTRUE / NEWFALSE
    if t is int:
        return _int(o, x)
    if t is float:
        return _float(o, <double>x)
    if t is str:
        s = PyUnicode_AsUTF8AndSize(x, &n)
        if s == NULL:  # lone surrogates: pickle writes them its own way ('surrogatepass')
            PyErr_Clear()
            return False
        return _blob(o, s, n, 0x8C, 0x58)  # SHORT_BINUNICODE / BINUNICODE
    if t is bytes:
        return _blob(o, PyBytes_AS_STRING(x), PyBytes_GET_SIZE(x), 0x43, 0x42)
    if depth <= 0:
        return False
    if t is tuple:
        n = len(x)
        if n == 0:
            return _op(o, 0x29)  # EMPTY_TUPLE
        if n > 3 and not _op(o, 0x28):  # MARK
            return False
        if not _items(o, x, n, depth):
            return False
        return _op(o, (0x85, 0x86, 0x87)[n - 1] if n <= 3 else 0x74)  # TUPLE1/2/3, TUPLE
    if t is list:
        n = len(x)
        if not _remember(o, x) or not _op(o, 0x5D):  # EMPTY_LIST
            return False
        if n == 0:
            return True
        if not _op(o, 0x28) or not _items(o, x, n, depth):  # MARK, the items
            return False
        return _op(o, 0x65)  # APPENDS
    if t is dict:
        if not _remember(o, x) or not _op(o, 0x7D):  # EMPTY_DICT
            return False
        if not len(x):
            return True
        if not _op(o, 0x28):  # MARK
            return False
        pos = 0
        while PyDict_Next(x, &pos, &k, &v):
            if not _value(o, <object>k, depth - 1) or not _value(o, <object>v, depth - 1):
                return False
        return _op(o, 0x75)  # SETITEMS
    if t is _ndarray and _ndarray is not None:
        return _array(o, x)
    return False


cdef object _ndarray = None


def set_ndarray(nd):
    """numpy.ndarray, once numpy is loaded (serialize.py; never imported here)."""
    global _ndarray
    _ndarray = nd


def dumps(obj):
    """A protocol-5 pickle of ``obj`` written directly, or None (see the module's doc)."""
    cdef Out o
    o.n = 0
    o.items = 0
    o.nseen = 0
    _byte(&o, 0x80)  # PROTO 5
    _byte(&o, 5)
    try:
        if not _value(&o, obj, MAXDEPTH):
            return None
    except Exception:  # an array whose attributes misbehave...: pickle's way decides
        return None
    if not _room(&o, 1):
        return None
    _byte(&o, 0x2E)  # STOP
    return PyBytes_FromStringAndSize(o.buf, o.n)
