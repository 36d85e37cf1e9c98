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
* an instance of a plain class (:func:`_plain_class`: a class statement's class, its bases
  too, no ``__slots__``, no pickling hook of its own, found by its module and qualified
  name): written as pickle writes it, ``cls.__new__(cls)`` (STACK_GLOBAL, NEWOBJ) and its
  ``__dict__`` (BUILD, unless empty).  An agent's checkpoint (its object, a few small
  arrays in a dict) took 9 µs through the array Pickler, mostly its per-object machinery;
* at most ``CAP`` bytes in all.

A list, dict, array or instance met twice (shared, or a cycle) makes it refuse: pickle would keep
them one object, and this writer keeps no memo.  Only exact types are written (a subclass
of int, a numpy scalar... is refused), so nothing's ``__reduce__`` is skipped.

Cost on the 2-core VM: 0.4-0.6 µs for ``(obs, reward)`` of an 8-float array and a float,
against 4.6 µs through serialize's array pickler; a call's message tuple likewise.
tests/test_fastpickle.py checks every shape against ``pickle.loads`` (hypothesis) and the
refusals.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

cdef extern from "Python.h":
    void PyErr_Clear()
    # declared here without Cython's ``except NULL``: NULL (lone surrogates) is a refusal
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size)

DEF CAP = 8192       # bytes written at most (a buffer on the C stack)
DEF MAXDEPTH = 6     # containers nested at most this deep (an instance: as its __dict__)
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
    return _cint(o, v)


cdef bint _cint(Out *o, long long v):
    """The int ``v`` as pickle writes it."""
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


# dtype.str of the array formats met so far, keyed by the buffer's format (at most 7
# characters, packed) and item size: an array is then written from its buffer alone, with
# no attribute lookup (dtype, kind, str, nbytes, flags, shape and tobytes() took 2-5 µs of
# a lockstep client's call). Filled once per format; the strs are kept alive by _dtype_strs.
DEF NDTYPES = 32
cdef uint64_t _dtype_keys[NDTYPES]
cdef PyObject *_dtype_vals[NDTYPES]
cdef int _ndtypes = 0
_dtype_strs = []


cdef inline uint64_t _format_key(const char *fmt, Py_ssize_t itemsize):
    """The cache key of a buffer format, or 0 if the format is too long to pack."""
    cdef uint64_t key = <uint64_t>(itemsize & 0xFF) << 56
    cdef int i = 0
    if fmt == NULL:
        fmt = b"B"  # (PEP 3118: no format means unsigned bytes)
    while fmt[i]:
        if i >= 7 or itemsize > 0xFF:
            return 0
        key |= (<uint64_t>(<unsigned char>fmt[i])) << (8 * i)
        i += 1
    return key


cdef object _dtype_str(object x, uint64_t key):
    """``x.dtype.str`` for an array of a plain kind (cached by ``key``), else None."""
    global _ndtypes
    cdef int i
    for i in range(_ndtypes):
        if _dtype_keys[i] == key:
            return <object>_dtype_vals[i]
    dt = x.dtype
    if dt.kind not in ("b", "i", "u", "f", "c"):
        return None
    s = dt.str
    if type(s) is not str:
        return None
    if _ndtypes < NDTYPES:
        _dtype_strs.append(s)
        _dtype_keys[_ndtypes] = key
        _dtype_vals[_ndtypes] = <PyObject *>s
        _ndtypes += 1
    return s


cdef object _plain_buffer(object x, Py_buffer *view):
    """``x.dtype.str`` with ``x``'s buffer taken into ``view`` (the caller releases it) when
    it is C-contiguous, of a plain kind and at most ``ARRAY_MAX`` bytes; else None, with no
    buffer held (not C-contiguous, a dtype that exports no buffer, too large...)."""
    try:
        PyObject_GetBuffer(x, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except Exception:
        return None
    dts = None
    try:
        if view.len <= ARRAY_MAX:
            key = _format_key(view.format, view.itemsize)
            if key != 0:
                dts = _dtype_str(x, key)
    finally:
        if dts is None:
            PyBuffer_Release(view)
    return dts


cdef tuple _shape(const Py_ssize_t *dims, Py_ssize_t ndim):
    """The shape tuple of ``dims[:ndim]``."""
    cdef Py_ssize_t k
    cdef object dim  # (an object: SET_ITEM steals the reference Py_INCREF takes for it)
    shape = PyTuple_New(ndim)
    for k in range(ndim):
        dim = dims[k]
        Py_INCREF(dim)
        PyTuple_SET_ITEM(shape, k, dim)
    return shape


cdef bint _array(Out *o, object x):
    """``_small_array(data, dtype.str, shape)`` under the extension code, from the array's
    buffer (C-contiguous, or refused)."""
    cdef Py_buffer view
    cdef Py_ssize_t i, n
    cdef const char *s
    if not _remember(o, x):
        return False
    dts = _plain_buffer(x, &view)
    if dts is None:  # pickle's way
        return False
    try:
        if view.ndim > 32:
            return False
        o.items += view.ndim + 2
        if o.items > MAXITEMS or not _room(o, 2):
            return False
        _byte(o, 0x82)  # EXT1
        _byte(o, EXT)
        if not _blob(o, <const char *>view.buf, view.len, 0x43, 0x42):
            return False
        s = PyUnicode_AsUTF8AndSize(dts, &n)
        if s == NULL or not _blob(o, s, n, 0x8C, 0x58):
            PyErr_Clear()
            return False
        # the shape, as pickle writes a tuple of ints
        if view.ndim == 0:
            if not _op(o, 0x29):  # EMPTY_TUPLE
                return False
        else:
            if view.ndim > 3 and not _op(o, 0x28):  # MARK
                return False
            for i in range(view.ndim):
                if not _cint(o, view.shape[i]):
                    return False
            if not _op(o, (0x85, 0x86, 0x87)[view.ndim - 1] if view.ndim <= 3 else 0x74):
                return False
    finally:
        PyBuffer_Release(&view)
    if not _room(o, 2):
        return False
    _byte(o, 0x87)  # TUPLE3: the arguments
    _byte(o, 0x52)  # REDUCE
    return True


cdef bint _value(Out *o, object x, int depth):
    cdef Py_ssize_t n
    cdef const char *s
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
        return _dict(o, <dict>x, depth)
    if t is _ndarray and _ndarray is not None:
        return _array(o, x)
    return _instance(o, x, t, depth)


cdef bint _dict(Out *o, dict x, int depth):
    """The dict ``x`` (EMPTY_DICT, then its items under MARK ... SETITEMS), one level down."""
    cdef Py_ssize_t pos = 0
    cdef PyObject *k
    cdef PyObject *v
    if not _remember(o, x) or not _op(o, 0x7D):  # EMPTY_DICT
        return False
    if not len(x):
        return True
    if not _op(o, 0x28):  # MARK
        return False
    while PyDict_Next(x, &pos, &k, &v):
        if not _value(o, <object>k, depth - 1) or not _value(o, <object>v, depth - 1):
            return False
    return _op(o, 0x75)  # SETITEMS


# -- instances of plain classes ----------------------------------------------------------
import copyreg as _copyreg
import sys

cdef int _HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class statement's class


class _Plain:
    pass


cdef Py_ssize_t _PLAIN_SIZE = _Plain.__basicsize__      # an instance's layout: a dict and
cdef Py_ssize_t _PLAIN_DICT = _Plain.__dictoffset__     # weak references, nothing else
cdef object _NO_GETSTATE = getattr(object, "__getstate__", None)  # (3.11+; None before)
cdef dict _plain_types = {}  # class -> (module, qualname, qualname's parts) or None
DEF MAX_TYPES = 512
cdef tuple _HOOKS = ("__reduce_ex__", "__reduce__", "__getstate__", "__getnewargs_ex__",
                     "__getnewargs__")


def _plain_class_check(t):
    """``(module, qualname, parts)`` if pickle writes an instance of class ``t`` as
    ``t.__new__(t)`` plus its ``__dict__`` (object's own ``__reduce_ex__``), else None:
    ``t`` and its bases are class statements' classes (no built-in base but object, no
    metaclass, no ``__slots__``), with object's layout (a dict, nothing else), and none
    defines ``__reduce__``, ``__reduce_ex__``, ``__getstate__``, ``__getnewargs__`` or
    ``__getnewargs_ex__``.  Looked at once per class (:func:`_plain_class`): a hook set
    on a class after one of its instances was written here is not seen (one registered
    with ``copyreg.pickle`` is)."""
    if type(t) is not type or not (t.__flags__ & _HEAPTYPE):
        return None
    mro = t.__mro__
    cdef Py_ssize_t i, last = len(mro) - 1  # (no negative indexes: wraparound is off)
    if mro[last] is not object:
        return None
    for i in range(last):
        c = mro[i]
        if type(c) is not type or not (c.__flags__ & _HEAPTYPE) or "__slots__" in c.__dict__:
            return None
    if t.__basicsize__ != _PLAIN_SIZE or t.__dictoffset__ != _PLAIN_DICT:
        return None
    if (t.__reduce_ex__ is not object.__reduce_ex__ or t.__reduce__ is not object.__reduce__
            or getattr(t, "__getstate__", None) is not _NO_GETSTATE
            or hasattr(t, "__getnewargs__") or hasattr(t, "__getnewargs_ex__")):
        return None
    module, qualname = t.__module__, t.__qualname__
    if type(module) is not str or type(qualname) is not str:
        return None
    if module == "__main__" and getattr(sys.modules.get(module), "__file__", None) is None:
        return None  # (python -c, a REPL, a notebook: no other process imports it; its
                     # classes go by value: stealer.shared.serialize.main_by_value)
    return module, qualname, tuple(qualname.split("."))


cdef object _plain_class(object t):
    """:func:`_plain_class_check`'s answer for ``t`` if ``t`` is what its module names now
    (pickle's own check: a local class, one made at run time or defined again since is
    refused) and no ``copyreg.pickle`` reducer is registered for it; else None.  Cached
    (either answer) for the classes their module names, which live as long as it."""
    info = _plain_types.get(t, False)
    if info is False:
        info = _plain_class_check(t)
        module, qualname = getattr(t, "__module__", None), getattr(t, "__qualname__", None)
        if type(module) is not str or type(qualname) is not str:
            return None
        if not _named(t, module, tuple(qualname.split("."))):
            return None  # (not kept: a class made at run time must not stay alive here)
        if len(_plain_types) < MAX_TYPES:
            _plain_types[t] = info
    elif info is None or not _named(t, (<tuple>info)[0], (<tuple>info)[2]):
        return None
    if info is None or t in _copyreg.dispatch_table:
        return None
    return info


cdef bint _named(object t, object module, tuple parts):
    """Is ``t`` what ``module`` (its name) and the parts of its qualified name find?"""
    return _resolve(module, parts) is t


cdef object _resolve(object module, tuple parts):
    """What pickle's ``find_class`` finds for ``module`` and a qualified name's ``parts``,
    if that module is imported already (else None; a missing attribute: None too)."""
    obj = sys.modules.get(module)
    if obj is None:
        return None
    for part in parts:
        obj = getattr(obj, part, None)
    return obj


cdef bint _instance(Out *o, object x, object t, int depth):
    """An instance of a plain class: ``module qualname STACK_GLOBAL () NEWOBJ``, then its
    ``__dict__`` and BUILD (none for an empty one: pickle's state is then None)."""
    cdef Py_ssize_t n
    cdef const char *s
    if depth <= 0:
        return False
    info = _plain_class(t)
    if info is None:
        return False
    d = x.__dict__
    if type(d) is not dict:
        return False
    for hook in _HOOKS:  # an instance's own hook is looked up before its class's
        if hook in <dict>d:
            return False
    if not _remember(o, x):
        return False
    for name in ((<tuple>info)[0], (<tuple>info)[1]):
        s = PyUnicode_AsUTF8AndSize(name, &n)
        if s == NULL or not _blob(o, s, n, 0x8C, 0x58):  # SHORT_BINUNICODE / BINUNICODE
            PyErr_Clear()
            return False
    if not _room(o, 3):
        return False
    _byte(o, 0x93)  # STACK_GLOBAL
    _byte(o, 0x29)  # EMPTY_TUPLE: __newobj__'s arguments
    _byte(o, 0x81)  # NEWOBJ
    if not len(<dict>d):
        return True
    return _dict(o, <dict>d, depth) and _op(o, 0x62)  # BUILD


cdef object _ndarray = None


# -- the array pickler's reducer (serialize._ArrayPickler) ------------------------------------
# A Pickler's reducer_override is called for every array (and every other object not of a
# built-in type) it meets: serialize's Python one read the array's nbytes, flags, dtype, its
# kind and str, its shape and tobytes() (0.66 µs an array; an agent's checkpoint holding
# five small arrays spent 3.3 µs there).  This one reads the buffer (0.1-0.2 µs).

cdef object _small_array_fn = None


def set_small_array(fn):
    """serialize._small_array: the constructor :func:`reduce_array` names (serialize.py)."""
    global _small_array_fn
    _small_array_fn = fn


def reduce_array(self, obj):
    """``serialize._ArrayPickler.reducer_override`` (its Python twin): for an array of
    exactly type ``ndarray``, C-contiguous, of a plain kind and at most ``ARRAY_MAX`` bytes,
    ``(_small_array, (data, dtype.str, shape))``; anything else NotImplemented (pickle's
    own way: a large array goes out of band)."""
    cdef Py_buffer view
    if type(obj) is not _ndarray or _ndarray is None or _small_array_fn is None:
        return NotImplemented
    dts = _plain_buffer(obj, &view)
    if dts is None:
        return NotImplemented
    try:
        shape = _shape(view.shape, view.ndim)
        data = PyBytes_FromStringAndSize(<const char *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    return _small_array_fn, (data, dts, shape)


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


# -- reading them back ------------------------------------------------------------------------
# ``loads(data)`` reads a pickle made of the opcodes :func:`dumps` writes (no frames, no
# memo, no globals but the array's extension code and plain classes whose instances pickle
# makes and fills with no code of theirs: no __setstate__, object's __new__; the reader may
# give up after making one, and pickle.loads then reads it all again) without an Unpickler, and builds the
# arrays without a Python call of serialize._small_array: a lockstep reply was read in
# 3-5 µs on a client whose caches the workers had just cleared, two thirds of the time it
# spent on a reply.  Anything else (a pickle from a Pickler starts with FRAME) goes to
# pickle.loads, as does anything this reader does not like: the result is always
# pickle.loads's (tests/test_fastpickle.py checks both against each other).

from cpython.bytearray cimport PyByteArray_FromStringAndSize
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcmp
from libc.stdint cimport int32_t, uint32_t

DEF MAXMARKS = 32

cdef object _fallback = None      # pickle.loads (set_loads)
cdef dict _dtypes_by_str = {}     # dtype.str -> numpy dtype, for arrays read back


def set_loads(f):
    """The reader of everything this module does not read itself (pickle.loads)."""
    global _fallback
    _fallback = f


cdef class _Ext:
    """The array's constructor on the reader's stack (EXT1 EXT, before its REDUCE)."""
    pass


cdef _Ext _EXT_MARK = _Ext()


cdef class _Cls:
    """A class on the reader's stack (STACK_GLOBAL, before its NEWOBJ)."""
    cdef object cls


cdef object _NOT_MINE = object()


cdef inline uint64_t _rd_le(const unsigned char *p, int k):
    cdef uint64_t v = 0
    cdef int i
    for i in range(k):
        v |= (<uint64_t>p[i]) << (8 * i)
    return v


cdef object _reader_ndarray():
    """numpy.ndarray for the reader, or None: numpy not met by dumps yet is looked up (it is
    loaded if such a reply came), never imported here."""
    if _ndarray is None:
        np = sys.modules.get("numpy")
        if np is None:
            return None
        set_ndarray(np.ndarray)
    return _ndarray


cdef object _dtype_of(str dts, object nd):
    """The dtype whose str is ``dts`` (kept in _dtypes_by_str); ValueError if ``dts`` is
    not a dtype's own str (a subarray spec such as ``8f8`` makes a float64 array of one
    more dimension here, where pickle's _small_array refuses the buffer: the reader gives
    such a pickle to pickle.loads)."""
    dt = _dtypes_by_str.get(dts)
    if dt is None:
        dt = nd((0,), dts).dtype
        if dt.str != dts:
            raise ValueError(f"{dts!r} is not a dtype's str")
        if len(_dtypes_by_str) < 64:
            _dtypes_by_str[dts] = dt
    return dt


cdef bint _fits(Py_ssize_t nbytes, object dt, const Py_ssize_t *dims, Py_ssize_t ndim) except -1:
    """Does a buffer of ``nbytes`` hold exactly an array of ``dims`` of ``dt``?  (What the
    writer wrote always does; numpy refusing a short one left a bytearray with an export.)"""
    cdef Py_ssize_t k, want = dt.itemsize
    for k in range(ndim):
        if dims[k] == 0:
            return nbytes == 0
    for k in range(ndim):
        if want > nbytes:
            return False
        want *= dims[k]
    return want == nbytes


cdef object _small_array_of(object args):
    if type(args) is not tuple or len(args) != 3:
        return _NOT_MINE
    data, dts, shape = args
    if type(data) is not bytes or type(dts) is not str or type(shape) is not tuple:
        return _NOT_MINE
    nd = _reader_ndarray()
    if nd is None:
        return _NOT_MINE
    cdef Py_ssize_t dims[32]
    cdef Py_ssize_t k, ndim = len(<tuple>shape)
    if ndim > 32:
        return _NOT_MINE
    for k in range(ndim):
        dim = (<tuple>shape)[k]
        if type(dim) is not int or dim < 0:
            return _NOT_MINE
        dims[k] = dim
    dt = _dtype_of(dts, nd)
    if not _fits(len(<bytes>data), dt, dims, ndim):
        return _NOT_MINE
    return nd(shape, dt, bytearray(data))


# dtype.str -> dtype of the arrays read back, keyed by the str's UTF-8 bytes as they lie in
# the pickle: no str made and no dict looked up per array (the dtypes stay alive in
# _dtype_objs).  Filled once per dtype, as _dtype_keys.
DEF NREAD_DTYPES = 16
DEF DTYPE_KEY = 15
cdef int _rd_lens[NREAD_DTYPES]
cdef char _rd_keys[NREAD_DTYPES][DTYPE_KEY]
cdef PyObject *_rd_vals[NREAD_DTYPES]
cdef int _nrd = 0
_dtype_objs = []


cdef object _read_dtype(const unsigned char *s, Py_ssize_t m, object nd):
    """The dtype whose str is ``s[:m]`` (UTF-8)."""
    global _nrd
    cdef int j
    for j in range(_nrd):
        if _rd_lens[j] == m and memcmp(_rd_keys[j], s, m) == 0:
            return <object>_rd_vals[j]
    dt = _dtype_of(PyUnicode_DecodeUTF8(<const char *>s, m, "surrogatepass"), nd)
    if _nrd < NREAD_DTYPES and m <= DTYPE_KEY:
        _dtype_objs.append(dt)
        memcpy(_rd_keys[_nrd], s, m)
        _rd_lens[_nrd] = <int>m
        _rd_vals[_nrd] = <PyObject *>dt
        _nrd += 1
    return dt


cdef inline Py_ssize_t _rd_blob(const unsigned char *p, Py_ssize_t i, Py_ssize_t n,
                                unsigned char short_op, unsigned char long_op,
                                const unsigned char **at, Py_ssize_t *m) noexcept:
    """The blob (``short_op``: 1-byte length, ``long_op``: 4-byte) at ``p[i]``: its bytes
    in ``at``/``m``; the position after it, or -1 if ``p[i]`` is not one or it overruns."""
    if i + 2 > n:
        return -1
    cdef int k = 1 if p[i] == short_op else (4 if p[i] == long_op else 0)
    if k == 0 or i + 1 + k > n:
        return -1
    m[0] = <Py_ssize_t>_rd_le(p + i + 1, k)
    i += 1 + k
    if m[0] > n - i:
        return -1
    at[0] = p + i
    return i + m[0]


cdef bint _fast_arrays = True


def set_fast_arrays(bint on):
    """Read arrays in one go (:func:`_fast_array`, the default) or one opcode at a time, as
    any other value (tests compare the two)."""
    global _fast_arrays
    _fast_arrays = on


cdef object _fast_array(const unsigned char *p, Py_ssize_t i, Py_ssize_t n, Py_ssize_t *end):
    """The array :func:`_array` wrote from ``p[i]`` on (after its EXT1 code) through its
    REDUCE, read in one go: ``end[0]`` is then the position after the REDUCE.  None (and
    nothing consumed) when the bytes are not exactly that, or building it raised: the
    stack machine then reads them one opcode at a time (and fails as it would)."""
    cdef unsigned char op
    cdef Py_ssize_t dlen = 0, slen = 0, ndim = 0, k
    cdef const unsigned char *dptr = NULL
    cdef const unsigned char *sptr = NULL
    cdef Py_ssize_t dims[32]
    cdef bint marked = False
    cdef int64_t d
    i = _rd_blob(p, i, n, 0x43, 0x42, &dptr, &dlen)  # SHORT_BINBYTES / BINBYTES: the data
    if i < 0:
        return None
    i = _rd_blob(p, i, n, 0x8C, 0x58, &sptr, &slen)  # SHORT_BINUNICODE / BINUNICODE: dtype.str
    if i < 0 or i >= n:
        return None
    if p[i] == 0x29:  # EMPTY_TUPLE: a 0-d array
        i += 1
    else:
        if p[i] == 0x28:  # MARK: more than 3 dimensions
            marked = True
            i += 1
        while i < n and ndim < 32:
            op = p[i]
            if op == 0x4B and i + 2 <= n:  # BININT1
                d = p[i + 1]
                i += 2
            elif op == 0x4D and i + 3 <= n:  # BININT2
                d = <int64_t>_rd_le(p + i + 1, 2)
                i += 3
            elif op == 0x4A and i + 5 <= n:  # BININT: signed, a dimension is not negative
                d = <int32_t>(<uint32_t>_rd_le(p + i + 1, 4))
                if d < 0:
                    return None
                i += 5
            else:
                break
            dims[ndim] = <Py_ssize_t>d
            ndim += 1
        if i >= n or ndim == 0:
            return None
        op = p[i]
        if marked:
            if op != 0x74 or ndim <= 3:  # TUPLE (the writer marks only past 3)
                return None
        elif ndim > 3 or op != 0x84 + ndim:  # TUPLE1/2/3
            return None
        i += 1
    if i + 2 > n or p[i] != 0x87 or p[i + 1] != 0x52:  # TUPLE3 (the arguments), REDUCE
        return None
    nd = _reader_ndarray()
    if nd is None:
        return None
    try:
        dt = _read_dtype(sptr, slen, nd)
        if not _fits(dlen, dt, dims, ndim):
            return None
        v = nd(_shape(dims, ndim), dt, PyByteArray_FromStringAndSize(<const char *>dptr, dlen))
    except Exception:
        return None
    end[0] = i + 2
    return v


cdef bint _marked(list stack, Py_ssize_t start):
    """Is an EXT1's mark or a class among ``stack[start:]`` (about to go into a value)?"""
    cdef Py_ssize_t j
    for j in range(start, len(stack)):
        if stack[j] is _EXT_MARK or type(stack[j]) is _Cls:
            return True
    return False


cdef dict _readable = {}  # class -> may the reader make and fill one itself


cdef bint _readable_class(object cls) except -1:
    """Does pickle make an instance of ``cls`` with no code of its own running: a plain
    class (:func:`_plain_class_check`) whose ``__new__`` is object's and that has no
    ``__setstate__``?  (The reader may still give up after it made one: pickle.loads then
    reads the pickle again, so nothing it did may show.)"""
    ok = _readable.get(cls)
    if ok is None:
        ok = (type(cls) is type and _plain_class_check(cls) is not None
              and cls.__new__ is object.__new__ and getattr(cls, "__setstate__", None) is None)
        if len(_readable) < MAX_TYPES:
            _readable[cls] = ok
    return ok


cdef object _global(object module, object qualname):
    """pickle's ``find_class(module, qualname)`` for a module already imported (else
    None: pickle's way imports it), if what it finds is a class the reader may make."""
    if type(module) is not str or type(qualname) is not str:
        return None
    obj = _resolve(module, tuple((<str>qualname).split(".")))
    if obj is None or not _readable_class(obj):
        return None
    return obj


cdef object _read(const unsigned char *p, Py_ssize_t n):
    """The value of pickle ``p[:n]`` if it is made of dumps's opcodes, else _NOT_MINE."""
    cdef Py_ssize_t i = 2, m, k, top
    cdef Py_ssize_t marks[MAXMARKS]
    cdef int nmarks = 0
    cdef unsigned char op
    cdef uint64_t u
    cdef int64_t s64
    cdef double d
    cdef list stack = []
    cdef int ext_open = 0  # EXT1s not reduced yet: their marks may not go into a value
    if n < 3 or p[0] != 0x80 or p[1] > 5:
        return _NOT_MINE
    while i < n:
        op = p[i]
        i += 1
        top = marks[nmarks - 1] if nmarks else 0
        if op == 0x2E:  # STOP
            if i != n or nmarks or len(stack) != 1 or ext_open:
                return _NOT_MINE
            return stack[0]
        elif op == 0x4E:  # NONE
            stack.append(None)
        elif op == 0x88:  # NEWTRUE
            stack.append(True)
        elif op == 0x89:  # NEWFALSE
            stack.append(False)
        elif op == 0x4B:  # BININT1
            if i + 1 > n:
                return _NOT_MINE
            stack.append(<long>p[i])
            i += 1
        elif op == 0x4D:  # BININT2
            if i + 2 > n:
                return _NOT_MINE
            stack.append(<long>_rd_le(p + i, 2))
            i += 2
        elif op == 0x4A:  # BININT: signed
            if i + 4 > n:
                return _NOT_MINE
            stack.append(<long>(<int32_t>(<uint32_t>_rd_le(p + i, 4))))
            i += 4
        elif op == 0x8A:  # LONG1 of 8 bytes (the writer's only length)
            if i + 9 > n or p[i] != 8:
                return _NOT_MINE
            u = _rd_le(p + i + 1, 8)
            memcpy(&s64, &u, 8)
            stack.append(s64)
            i += 9
        elif op == 0x47:  # BINFLOAT: big-endian
            if i + 8 > n:
                return _NOT_MINE
            u = 0
            for k in range(8):
                u = (u << 8) | p[i + k]
            memcpy(&d, &u, 8)
            stack.append(d)
            i += 8
        elif op == 0x8C or op == 0x58 or op == 0x43 or op == 0x42:
            # SHORT_BINUNICODE, BINUNICODE, SHORT_BINBYTES, BINBYTES
            k = 1 if (op == 0x8C or op == 0x43) else 4
            if i + k > n:
                return _NOT_MINE
            m = <Py_ssize_t>_rd_le(p + i, k)
            i += k
            if m > n - i:
                return _NOT_MINE
            if op == 0x8C or op == 0x58:  # as pickle reads them
                stack.append(PyUnicode_DecodeUTF8(<const char *>(p + i), m, "surrogatepass"))
            else:
                stack.append(PyBytes_FromStringAndSize(<const char *>(p + i), m))
            i += m
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(())
        elif 0x85 <= op <= 0x87:  # TUPLE1/2/3
            k = op - 0x84
            if len(stack) - top < k or (ext_open and _marked(stack, len(stack) - k)):
                return _NOT_MINE
            t = tuple(stack[len(stack) - k:])
            del stack[len(stack) - k:]
            stack.append(t)
        elif op == 0x28:  # MARK
            if nmarks >= MAXMARKS:
                return _NOT_MINE
            marks[nmarks] = len(stack)
            nmarks += 1
        elif op == 0x74:  # TUPLE: the items since the mark
            if not nmarks or (ext_open and _marked(stack, top)):
                return _NOT_MINE
            nmarks -= 1
            t = tuple(stack[top:])
            del stack[top:]
            stack.append(t)
        elif op == 0x5D:  # EMPTY_LIST
            stack.append([])
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x65 or op == 0x75:  # APPENDS, SETITEMS: into what is below the mark
            if not nmarks or top < 1 or (ext_open and _marked(stack, top)):
                return _NOT_MINE
            nmarks -= 1
            into = stack[top - 1]
            items = stack[top:]
            del stack[top:]
            if op == 0x65:
                if type(into) is not list:
                    return _NOT_MINE
                (<list>into).extend(items)
            else:
                if type(into) is not dict or len(items) & 1:
                    return _NOT_MINE
                for k in range(0, len(items), 2):
                    (<dict>into)[items[k]] = items[k + 1]
        elif op == 0x82:  # EXT1: only the array's code
            if i + 1 > n or p[i] != EXT:
                return _NOT_MINE
            # the whole array at once, as _array wrote it
            v = _fast_array(p, i + 1, n, &m) if _fast_arrays else None
            if v is not None:
                stack.append(v)
                i = m
                continue
            stack.append(_EXT_MARK)
            ext_open += 1
            i += 1
        elif op == 0x93:  # STACK_GLOBAL: only a plain class, for the NEWOBJ that follows
            if len(stack) - top < 2:
                return _NOT_MINE
            c = _global(stack[len(stack) - 2], stack[len(stack) - 1])
            if c is None:
                return _NOT_MINE
            del stack[len(stack) - 1]
            marker = _Cls()
            marker.cls = c
            stack[len(stack) - 1] = marker
            ext_open += 1
        elif op == 0x81:  # NEWOBJ: cls.__new__(cls), no arguments (object.__new__)
            if len(stack) - top < 2 or type(stack[len(stack) - 2]) is not _Cls:
                return _NOT_MINE  # (bounds first: this module's indexing is unchecked)
            args = stack[len(stack) - 1]  # (no comparison with (): it could run an __eq__)
            if type(args) is not tuple or len(<tuple>args):
                return _NOT_MINE
            del stack[len(stack) - 1]
            stack[len(stack) - 1] = object.__new__((<_Cls>stack[len(stack) - 1]).cls)
            ext_open -= 1
        elif op == 0x62:  # BUILD: a dict of state into an instance the reader made
            if len(stack) - top < 2:
                return _NOT_MINE
            state = stack[len(stack) - 1]
            inst = stack[len(stack) - 2]
            if type(state) is not dict or not _readable_class(type(inst)):
                return _NOT_MINE
            idict = inst.__dict__
            for key, value in (<dict>state).items():  # (pickle's load_build: str keys
                if type(key) is str:                   # interned, set in the dict itself)
                    key = sys.intern(key)
                idict[key] = value
            del stack[len(stack) - 1]
        elif op == 0x52:  # REDUCE: only of the array's constructor
            if len(stack) - top < 2 or stack[len(stack) - 2] is not _EXT_MARK:
                return _NOT_MINE
            v = _small_array_of(stack.pop())
            if v is _NOT_MINE:
                return _NOT_MINE
            stack[len(stack) - 1] = v
            ext_open -= 1
        else:
            return _NOT_MINE
    return _NOT_MINE


def loads(data):
    """``pickle.loads(data)``, faster for what :func:`dumps` writes (bytes only)."""
    if type(data) is bytes:
        try:
            v = _read(<const unsigned char *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
        except Exception:  # pickle's way decides (and raises, if it must)
            v = _NOT_MINE
        if v is not _NOT_MINE:
            return v
    return _fallback(data)
