"""The native writer of small pickles (native/_fastpickle.pyx) against pickle itself.

Whatever it writes, ``pickle.loads`` must read back equal to the input, with the same
types (a tuple stays a tuple, an int an int, an array a writable ndarray of the same dtype
and shape); whatever it cannot write as pickle would (a subclass, an object met twice, an
int past 64 bits, a lone surrogate, a big or non-contiguous array, too deep, too large) it
must refuse with None, and ``serialize.dumps`` then pickles it the usual way.

Its reader, ``loads``, must read everything the writer writes itself (never handing it to
pickle.loads; an instance whose class has a ``__setstate__`` excepted: its code runs on
load), give what pickle.loads gives, and hand whatever else it is given (a Pickler's
output, a truncated or altered pickle) to pickle.loads.
"""

from __future__ import annotations

import copyreg
import dataclasses
import math
import pickle
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stealer.shared import serialize

fp = pytest.importorskip("stealer._fastpickle", reason="the native extension is not built")
fp.set_ndarray(np.ndarray)


def same(a: object, b: object) -> bool:
    """Equal values of the same types, all the way down (NaN equal to NaN); ``a`` is the one
    read back, whose arrays must be writable."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (a.dtype == b.dtype and a.shape == b.shape and a.flags.writeable
                and a.tobytes() == b.tobytes())
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a).__module__ == __name__:  # an instance of a class below: its attributes
        return same(vars(a), vars(b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


# -- instances --------------------------------------------------------------------------------
class Plain:
    def __init__(self, **attrs: object) -> None:
        self.__dict__.update(attrs)


class Child(Plain):
    pass


@dataclasses.dataclass
class Point:
    x: float
    y: float


class Restores(Plain):
    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, restored=True)


# refused: each has a pickling hook of its own, another layout, or another metaclass
class Reduces(Plain):
    def __reduce__(self) -> tuple:
        return (Plain, ())


class ReducesEx(Plain):
    def __reduce_ex__(self, proto: object) -> tuple:
        return (Plain, ())


class GetState(Plain):
    def __getstate__(self) -> dict:
        return {}


class NewArgs(Plain):
    def __getnewargs__(self) -> tuple:
        return ()


class Slotted:
    __slots__ = ("a",)


@dataclasses.dataclass(slots=True)
class SlottedPoint:
    x: float


class MyList(list):
    pass


class MyError(Exception):
    pass


class Meta(type):
    pass


class WithMeta(metaclass=Meta):
    pass


class Redefined(Plain):
    pass


def _local_instance() -> object:
    class Local:
        pass

    return Local()


def _own_hook(name: str = "__reduce_ex__") -> object:
    p = Plain()
    setattr(p, name, lambda *a: (Plain, ()))  # an instance's own hook comes first
    return p


shared_point = Point(1.0, 2.0)


dtypes = st.sampled_from(["<f4", "<f8", ">f8", "<i8", "|u1", "<i2", "|b1", "<c16"])
arrays = st.builds(
    lambda dt, shape, seed: np.random.default_rng(seed).integers(0, 100, shape).astype(dt),
    dtypes, st.lists(st.integers(0, 4), max_size=3).map(tuple), st.integers(0, 2**32 - 1))
atoms = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
         | st.floats(allow_nan=True) | st.text(max_size=300) | st.binary(max_size=300) | arrays)
values = st.recursive(
    atoms,
    lambda kids: (st.lists(kids, max_size=5) | st.lists(kids, max_size=5).map(tuple)
                  | st.dictionaries(st.text(max_size=5) | st.integers(), kids, max_size=4)),
    max_leaves=20)


values_and_objects = st.recursive(
    atoms,
    lambda kids: (st.lists(kids, max_size=5) | st.lists(kids, max_size=5).map(tuple)
                  | st.dictionaries(st.text(max_size=5) | st.integers(), kids, max_size=4)
                  | st.dictionaries(st.text(min_size=1, max_size=5), kids, max_size=4).map(
                      lambda attrs: Plain(**attrs))
                  | st.builds(Point, kids, kids)),
    max_leaves=20)

written: list[bool] = []


@settings(max_examples=400, deadline=None)
@given(values)
def test_what_it_writes_loads_back_as_pickle_would(v):
    data = fp.dumps(v)
    if data is None:  # refused: only for what it says it refuses (test_what_it_refuses)
        written.append(False)
        return
    written.append(True)
    assert same(pickle.loads(data), v)
    assert same(pickle.loads(data), pickle.loads(pickle.dumps(v, 5)))


@settings(max_examples=300, deadline=None)
@given(values_and_objects)
def test_objects_it_writes_load_back_as_pickle_would(v):
    """Instances of plain classes anywhere in a value: what pickle.loads and the native
    reader read back equals the value and what pickle's own pickle of it reads back; the
    reader reads them itself (their classes have no ``__setstate__``)."""
    data = fp.dumps(v)
    if data is None:
        return
    assert same(pickle.loads(data), v)
    assert same(pickle.loads(data), pickle.loads(pickle.dumps(v, 5)))
    s = Spy()
    fp.set_loads(s)
    try:
        assert same(fp.loads(data), v)
        assert not s.handed
    finally:
        fp.set_loads(pickle.loads)


def test_the_reader_hands_on_an_instance_whose_class_runs_code_of_its_own(spy):
    """A class with ``__setstate__`` (its code runs on load), or one whose module is not
    imported (pickle imports it): pickle.loads reads those, once.  A class the writer
    would refuse, named in a Pickler's pickle, likewise."""
    data = fp.dumps(Restores(n=3))
    got = fp.loads(data)
    assert spy.handed == [data] and got.restored is True and got.n == 3
    spy.handed.clear()
    gone = data.replace(b"test_fastpickle", b"test_fastpickl_")  # (same length)
    with pytest.raises(ModuleNotFoundError):
        fp.loads(gone)
    assert spy.handed == [gone]
    spy.handed.clear()
    pk = pickle.dumps(NewArgs(a=1), 5)
    assert fp.loads(pk).a == 1 and spy.handed == [pk]


class Spy:
    """The reader's fallback, counting what it was handed."""

    def __init__(self) -> None:
        self.handed: list[bytes] = []

    def __call__(self, data: bytes) -> object:
        self.handed.append(data)
        return pickle.loads(data)


@pytest.fixture
def spy():
    s = Spy()
    fp.set_loads(s)
    try:
        yield s
    finally:
        fp.set_loads(pickle.loads)  # (serialize's setting)


@settings(max_examples=300, deadline=None)
@given(values)
def test_the_reader_reads_what_the_writer_writes_as_pickle_would(v):
    s = Spy()
    fp.set_loads(s)
    try:
        data = fp.dumps(v)
        if data is None:
            return
        assert same(fp.loads(data), v)
        assert not s.handed  # read natively, not by pickle.loads
        # and a Pickler's pickle of the same value reads the same (handed on, or read)
        assert same(fp.loads(pickle.dumps(v, 5)), pickle.loads(pickle.dumps(v, 5)))
    finally:
        fp.set_loads(pickle.loads)


@pytest.mark.parametrize("proto", range(6))
def test_the_reader_gives_what_pickle_gives_for_any_protocol(spy, proto):
    for v in [None, 1, -5, 2**40, "é", b"x", (1, 2), [1, [2]], {"a": (1,)}, 1.5, True,
              np.arange(3.0), {1, 2}, Spy]:
        data = pickle.dumps(v, proto)
        got = fp.loads(data)
        assert same(got, pickle.loads(data)) if not isinstance(v, type) else got is v


def test_a_truncated_or_altered_pickle_is_read_as_pickle_would(spy):
    """Every prefix and every one-byte change of a lockstep reply's pickle: the reader either
    hands it to pickle.loads, or reads it exactly as pickle.loads does (then it is made of
    the writer's opcodes only, so pickle.loads is safe to run on it here)."""
    data = fp.dumps((np.arange(4, dtype=np.float32), 0.5, "ok", [1, {"k": None}], (1, 2, 3, 4),
                     Plain(p=Point(1.0, 2.0), e=Plain())))
    variants = [data[:k] for k in range(len(data))]
    for i in range(2, len(data)):
        for b in (0x00, 0x01, 0x28, 0x29, 0x2E, 0x52, 0x62, 0x65, 0x74, 0x75, 0x81, 0x82,
                  0x85, 0x93, 0xF5, 0xFF, data[i] ^ 0x01):
            variants.append(data[:i] + bytes([b]) + data[i + 1:])
    read = 0
    for x in variants:
        spy.handed.clear()
        try:
            got = fp.loads(x)
        except Exception:
            assert spy.handed == [x]  # only pickle.loads raises
            continue
        if spy.handed:
            continue  # pickle.loads's own result
        read += 1
        assert same(got, pickle.loads(x))
    assert read >= 20  # some altered ones are still the writer's opcodes (a changed number)


@pytest.mark.parametrize("in_one_go", [True, False])
def test_an_array_whose_dtype_or_size_was_altered_is_pickle_s_to_read(spy, in_one_go):
    """Found by fuzzing the reader: a dtype str that is no dtype's own (``8f8``, a subarray
    spec) made a float64 array natively where pickle's _small_array refuses the buffer;
    a buffer larger than its shape needs (pickle reads it) or smaller (pickle refuses)
    is pickle's to decide too."""
    fp.set_fast_arrays(in_one_go)
    try:
        data = fp.dumps(np.arange(4.0))
        assert b"<f8" in data and b"K\x04\x85" in data
        for bad in (data.replace(b"<f8", b"8f8"), data.replace(b"K\x04\x85", b"K\x05\x85"),
                    data.replace(b"K\x04\x85", b"K\x03\x85")):
            spy.handed.clear()
            try:
                want = pickle.loads(bad)
            except Exception as exc:
                with pytest.raises(type(exc)):
                    fp.loads(bad)
            else:
                assert same(fp.loads(bad), want)
            assert spy.handed == [bad]
    finally:
        fp.set_fast_arrays(True)


def test_randomly_altered_pickles_are_read_as_pickle_would_or_handed_on():
    """Seeded random edits (a byte changed, removed, or an opcode of the reader's put in)
    of pickles with instances and arrays: the reader never crashes, and what it reads
    itself pickle.loads reads the same (only then is pickle.loads run here: an altered
    pickle handed on may hold a memo opcode asking for gigabytes)."""
    import random

    rng = random.Random(7)
    base = [fp.dumps(v) for v in (
        Plain(a=Point(1.0, 2.0), b=[Child(x=np.arange(3.0))], c={"k": Plain()}),
        (Point(0.5, -1.0), Plain(), "s", 3), [Plain(p=Plain(q=Plain(r=1)))],
        (np.arange(6, dtype=np.int16).reshape(2, 3), np.zeros((1, 1, 1, 2), np.float32)))]
    handed: list[bytes] = []
    fp.set_loads(handed.append)
    read = 0
    try:
        for _ in range(20000):
            b = bytearray(rng.choice(base))
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(2, len(b))
                r = rng.random()
                if r < 0.5:
                    b[i] = rng.randrange(256)
                elif r < 0.75:
                    del b[i]
                else:
                    b.insert(i, rng.choice([0x93, 0x81, 0x62, 0x29, 0x28, 0x75, 0x2E, 0x8C, 0x85]))
            data = bytes(b)
            handed.clear()
            try:
                got = fp.loads(data)
            except Exception:  # only the fallback may raise (here it never does)
                raise AssertionError(f"the reader raised on {data!r}") from None
            if handed:
                continue
            read += 1
            assert _same_shape(got, pickle.loads(data)), data
    finally:
        fp.set_loads(pickle.loads)
    assert read > 500  # (many edits keep the writer's opcodes: a changed number, a name)


def _same_shape(a: object, b: object) -> bool:
    """:func:`same`, with instances used as dict keys (an edit can make one) compared by
    what they hold, not by identity."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            _same_shape(ka, kb) and _same_shape(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_shape(x, y) for x, y in zip(a, b))
    if type(a).__module__ == __name__:
        return _same_shape(vars(a), vars(b))
    return same(a, b)


def test_the_model_test_writes_most_of_its_examples():
    """The model above is not a test of refusals: most of what it draws is written."""
    written.clear()
    test_what_it_writes_loads_back_as_pickle_would()  # (a @given test runs every example)
    assert len(written) >= 100 and sum(written) >= 0.7 * len(written)


@pytest.mark.parametrize("v", [
    None, True, False, 0, 255, 256, 65535, 65536, -1, -(2**31), 2**31 - 1, 2**31,
    2**63 - 1, -(2**63), 0.0, -0.0, 1.5, float("inf"), float("nan"), "", "act", "é" * 300,
    b"", b"x" * 300, (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), [], [1, [2]], {}, {"a": 1},
    np.zeros(0), np.array(True), np.arange(6, dtype=np.int64).reshape(2, 3),
    np.array([1 + 2j]), np.arange(8, dtype=np.float32),
    # written from the buffer: more than 3 dimensions, float16, a byte-swapped or
    # read-only array, a Fortran-ordered one that is C-contiguous too
    np.arange(16, dtype=np.int16).reshape(2, 2, 2, 2), np.zeros((1, 1, 1, 1, 2)),
    np.arange(4, dtype=np.float16), np.arange(4, dtype=">f4"), np.arange(3, dtype=">i8"),
    np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8), np.asfortranarray(np.arange(3.0)),
    # a lockstep call's message and its reply
    (5, "act", (np.array([0.1, 0.2], dtype=np.float32),), None, 7, None, None, 0, 0),
    (np.arange(8, dtype=np.float32), 0.5),
    [[[[[[1]]]]]],                           # as deep as it goes
    # instances of plain classes: empty, with attributes, nested, a dataclass, a subclass,
    # one whose class reads its state back itself (__setstate__)
    Plain(), Plain(a=1, b=[2.5, "x"]), Plain(inner=Plain(arr=np.arange(3.0))), Point(1.0, 2.0),
    Child(k={"x": None}), Restores(n=3), [Point(0.0, 1.0), Point(2.0, 3.0)],
])
def test_the_shapes_it_writes(v):
    data = fp.dumps(v)
    assert data is not None, v
    assert same(pickle.loads(data), pickle.loads(pickle.dumps(v, 5)))
    assert same(pickle.loads(data), v) or type(v) is Restores  # (it marks what it reads)


class Int(int):
    pass




shared = [1]
cyclic: list = []
cyclic.append(cyclic)


@pytest.mark.parametrize("v", [
    2**63, -(2**63) - 1,                     # past 64 bits
    "\ud800",                                # a lone surrogate
    Int(3), np.float64(1.0), np.int64(2),    # subclasses and numpy scalars
    np.zeros(1000),                          # an array past INBAND_MAX
    np.zeros((4, 4))[:, 1],                  # not C-contiguous
    np.array(["a"]), np.array([object()]),   # not a plain kind
    np.zeros(2, dtype=[("a", "<f4")]),       # structured
    np.zeros(2, dtype="M8[s]"), np.zeros(2, dtype="m8[s]"),  # dates, durations
    np.asfortranarray(np.zeros((2, 3))),     # Fortran order only
    np.zeros(4).view(np.matrix),             # an ndarray subclass
    (shared, shared), cyclic,                # met twice: pickle keeps one object
    [[[[[[[1]]]]]]],                         # too deep
    b"x" * 9000, [1] * 300,                  # too large, too many items
    {1, 2}, object(), len,                   # other types
    Reduces(), ReducesEx(), GetState(), NewArgs(), Slotted(), SlottedPoint(1.0),
    MyList(), MyError("x"), WithMeta(), _local_instance(), _own_hook(),
    _own_hook("__getstate__"), _own_hook("__getnewargs__"),
    (shared_point, shared_point),            # met twice
    Plain(a=Plain(b=Plain(c=Plain(d=Plain(e=Plain(f=Plain())))))),  # too deep
    Plain, Point,                            # classes themselves: pickle's way
])
def test_what_it_refuses(v):
    assert fp.dumps(v) is None


def test_an_instance_is_refused_once_its_class_is_not_what_its_module_names(monkeypatch):
    """pickle's own check (its class is looked up by name on load): a class defined again
    (a notebook cell run twice) or registered with copyreg is pickle's to decide."""
    r = Redefined(a=1)
    assert fp.dumps(r) is not None  # (and its answer is cached)
    monkeypatch.setattr(sys.modules[__name__], "Redefined", type("Redefined", (Plain,), {}))
    assert fp.dumps(r) is None
    monkeypatch.undo()
    assert fp.dumps(r) is not None
    copyreg.pickle(Redefined, lambda x: (Redefined, ()))
    try:
        assert fp.dumps(r) is None
    finally:
        del copyreg.dispatch_table[Redefined]
    assert same(pickle.loads(fp.dumps(r)), r)


def test_an_agent_checkpoint_takes_the_native_writer():
    """An agent's state (its object, a nested object, small arrays, a dict, a list) as the
    host checkpoints it: written natively, and read back as pickle reads it."""
    from stealer.bench.lockstep import LockstepAgent

    if serialize._fast is None:
        pytest.skip("the fast writer is off in this build (STEALER_NO_EXTENSIONS)")
    agent = LockstepAgent(3, 0, 2)
    agent.act(np.zeros(2, np.float32))
    state = (agent, 1, 1, 1, 0, (1, False, 0.0), None)
    data, bufs = serialize.dumps(state, "agent state", arrays=True)
    assert not bufs and data == fp.dumps(state)
    back = pickle.loads(data)
    assert back[0].summary() == agent.summary() and back[0].env.info == agent.env.info
    assert same(back[0].env.pos, agent.env.pos) and back[1:] == state[1:]


def test_a_shared_array_stays_one_object_through_dumps():
    a = np.arange(3)
    data, _ = serialize.dumps((a, a))
    x, y = pickle.loads(data)
    assert x is y


def test_serialize_dumps_takes_it_and_a_call_message_fits_inline():
    from stealer.agents.message import encode_message
    from stealer.shared.arena import INLINE

    if serialize._fast is None:
        pytest.skip("the fast writer is off in this build (STEALER_NO_EXTENSIONS)")
    v = (np.arange(8, dtype=np.float32), 0.25)
    data, bufs = serialize.dumps(v)
    assert not bufs and data == fp.dumps(v)
    msg, bufs = encode_message(5, "act", (np.array([0.1, 0.2], dtype=np.float32),), {}, 7, None)
    assert not bufs and len(msg) <= INLINE


# -- the array pickler's native reducer (reduce_array) against its Python twin --------------

REDUCE_CASES = [
    np.zeros(0), np.array(True), np.arange(6, dtype=np.int64).reshape(2, 3),
    np.array([1 + 2j]), np.arange(8, dtype=np.float32), np.arange(16, dtype=np.int16).reshape(2, 2, 2, 2),
    np.arange(4, dtype=np.float16), np.arange(4, dtype=">f4"), np.zeros((1, 1, 1, 1, 2)),
    np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8), np.asfortranarray(np.arange(3.0)),
    np.zeros(256),                                   # exactly INBAND_MAX bytes
    np.zeros(300, np.float32), np.zeros((0, 70000)),  # dimensions past the cached small ints
    # refused by both: too large, not C-contiguous, not a plain kind, a subclass
    np.zeros(257), np.zeros((4, 4))[:, 1], np.array(["a"]), np.array([object()]),
    np.zeros(2, dtype=[("a", "<f4")]), np.zeros(2, dtype="M8[s]"),
    np.asfortranarray(np.zeros((2, 3))), np.zeros(4).view(np.matrix),
    np.float64(1.0), 3, "x", (1, 2), None,
]


@pytest.mark.parametrize("x", REDUCE_CASES, ids=lambda x: f"{type(x).__name__}-{getattr(x, 'dtype', '')}-{getattr(x, 'shape', '')}")
def test_the_native_reducer_reduces_as_the_python_one(x):
    if serialize._Pickler is serialize._ArrayPickler:
        pytest.skip("the native reducer is off in this build")
    serialize._found_numpy(np)
    want = serialize._ArrayPickler.reducer_override(None, x)
    got = fp.reduce_array(None, x)
    if want is NotImplemented:
        assert got is NotImplemented
        return
    assert got[0] is want[0] is serialize._small_array
    assert got[1] == want[1] and type(got[1][2]) is tuple
    del want, got
    assert same(pickle.loads(serialize.dumps([x, x.shape], arrays=True)[0]), [x, x.shape])


@settings(max_examples=200, deadline=None)
@given(values)
def test_an_agent_state_pickled_with_the_array_pickler_loads_back_the_same(v):
    """serialize.dumps(arrays=True), an agent's checkpoint: arrays at any depth, inside an
    object too, read back equal and writable."""
    box = Box(v)
    data, bufs = serialize.dumps((box, [box.v], {"k": v}), "agent state", arrays=True)
    back = pickle.loads(data, buffers=bufs)
    assert same(back[0].v, v) and same(back[1][0], v) and same(back[2]["k"], v)
    assert back[1][0] is back[0].v or not isinstance(v, (list, dict, np.ndarray))


class Box:
    def __init__(self, v: object) -> None:
        self.v = v


array_shapes = st.lists(st.sampled_from([0, 1, 2, 3, 255, 256, 70000]), max_size=6).filter(
    lambda sh: (int(np.prod(sh)) * 16 <= 2048 or 0 in sh)
    and math.prod(d for d in sh if d) < 2**40).map(tuple)  # (numpy's size limit, with a 0)


@settings(max_examples=300, deadline=None)
@given(dtypes, array_shapes, st.integers(0, 2**32 - 1))
def test_an_array_read_in_one_go_is_the_one_read_opcode_by_opcode(dt, shape, seed):
    """_fast_array (the whole array at once) against the reader's stack machine and
    pickle.loads: 0-d arrays, up to 3 dimensions (TUPLE1-3), more (MARK ... TUPLE),
    dimensions written as BININT1, BININT2 and BININT, empty arrays."""
    v = (np.random.default_rng(seed).integers(0, 100, shape).astype(dt), [shape])
    data = fp.dumps(v)
    if data is None:  # too large for the writer
        return
    s = Spy()
    fp.set_loads(s)
    try:
        fast = fp.loads(data)
        fp.set_fast_arrays(False)
        slow = fp.loads(data)
    finally:
        fp.set_fast_arrays(True)
        fp.set_loads(pickle.loads)
    assert not s.handed
    assert same(fast, v) and same(slow, v) and same(fast, pickle.loads(data))
