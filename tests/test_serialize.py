"""Serialization: pickle/cloudpickle fallback, out-of-band frames, the function table."""

from __future__ import annotations

import mmap
import pickle
import threading

import numpy as np
import pytest
import tasks

from stealer.errors import SerializationError
from stealer.shared import queues as _queues
from stealer.shared import serialize


def test_plain_objects_use_stdlib_pickle():
    data, bufs = serialize.dumps((1, "a", [2.5]))
    assert not bufs and pickle.loads(data) == (1, "a", [2.5])


def test_lambdas_fall_back_to_cloudpickle():
    k = 3
    data, _ = serialize.dumps(lambda x: x + k)
    assert pickle.loads(data)(1) == 4


def test_unpicklable_raises_serialization_error_naming_what():
    with pytest.raises(SerializationError, match="could not pickle the task result") as info:
        serialize.dumps(threading.Lock(), "task result")
    assert isinstance(info.value, pickle.PicklingError)


def test_numpy_arrays_travel_out_of_band():
    a = np.arange(10_000, dtype=np.float64)
    data, bufs = serialize.dumps({"x": a, "y": 1})
    assert len(bufs) == 1 and bufs[0].raw().nbytes == a.nbytes
    assert len(data) < 1000  # the array's bytes are not in the pickle stream
    n = serialize.frame_size(data, bufs)
    mm = mmap.mmap(-1, n + 64)
    serialize.write_frame(mm, 64, data, bufs)
    out = serialize.loads_frame(mm[64 : 64 + n], True)
    np.testing.assert_array_equal(out["x"], a)
    assert out["x"].flags.writeable and out["y"] == 1
    mm.close()


def test_small_arrays_stay_in_the_pickle_and_large_ones_do_not():
    """Up to INBAND_MAX bytes a buffer is pickled in-band (no frame, a native path can
    take the payload); above, out-of-band. The same rule for dumps, dump_result and the
    native worker's finish_value (which refuses only the out-of-band ones)."""
    edge = np.zeros(serialize.INBAND_MAX // 8, np.float64)  # exactly INBAND_MAX bytes
    over = np.zeros(serialize.INBAND_MAX // 8 + 1, np.float64)
    data, bufs = serialize.dumps((edge, 1.5))
    assert not bufs and len(data) > edge.nbytes
    out = pickle.loads(data)[0]
    np.testing.assert_array_equal(out, edge)
    assert out.flags.writeable
    data, bufs = serialize.dumps([edge, over, edge])
    assert [b.raw().nbytes for b in bufs] == [over.nbytes]
    assert pickle.loads(serialize.dump_result(edge)).nbytes == edge.nbytes
    with pytest.raises(serialize._HasBuffers):
        serialize.dump_result(over)


def test_function_table_sends_a_function_once():
    Q = _queues.impl
    mm = mmap.mmap(-1, 1 << 16)
    region = Q.Region(mm)
    client = serialize.FunctionTable(mm, region, 0, 16, 4096, 8192)
    worker = serialize.FunctionTable(mm, region, 0, 16, 4096, 8192)
    fid = client.id_of(tasks.square)
    assert fid == 0 and client.id_of(tasks.square) == 0
    assert client.id_of(tasks.add) == 1
    assert worker.get(0)(7) == 49
    assert worker.id_known(tasks.square) == 0 and worker.id_known(tasks.add) == -1
    # bound methods and partials carry state: never cached
    assert client.id_of([].append) == -1
    import math

    assert serialize.cacheable(math.sqrt) and serialize.cacheable(len)
    import functools

    assert client.id_of(functools.partial(tasks.add, 1)) == -1
    with pytest.raises(SerializationError):
        worker.get(5)
    # a full table degrades to sending the function with each task
    for i in range(2, 16):
        client.id_of(eval(f"lambda x: x + {i}"))  # distinct function objects
    assert client.id_of(lambda x: x) == -1


# -- small arrays: their bytes, dtype and shape, not numpy's reduction ---------------------

SMALL_ARRAYS = [
    np.zeros(2, np.float32),
    np.arange(6, dtype=np.int16).reshape(2, 3),
    np.array(3.5),  # 0-d
    np.zeros(0),
    np.array([True, False]),
    np.array([1 + 2j, 3j], np.complex64),
    np.arange(4, dtype=">i4"),  # big-endian: the dtype's string keeps the byte order
]


@pytest.mark.parametrize("a", SMALL_ARRAYS, ids=lambda a: f"{a.dtype.str}{a.shape}")
def test_a_small_array_round_trips_writable_with_its_dtype_and_shape(a):
    for obj in (a, (a,), (1, "act", (a, 2.0), None), [[a]], (a, a)):
        data, bufs = serialize.dumps(obj)
        assert not bufs
        # the short way (the extension code of _small_array), not numpy's reduction
        assert bytes([pickle.EXT1[0], serialize._SMALL_ARRAY_CODE]) in data
        assert b"numpy" not in data
        back = pickle.loads(data)
        got = back
        while not isinstance(got, np.ndarray):
            got = got[-1] if not isinstance(got, tuple) or len(got) < 3 else got[2][0]
        assert got.dtype == a.dtype and got.shape == a.shape
        assert np.array_equal(got, a)
        assert got.flags.writeable
        got[...] = 0  # the handler may write into what it received


def test_a_call_with_a_small_array_fits_a_record_inline():
    """The lockstep yardstick's message (a 2-float action) fits INLINE: the native call
    path (HotPath.post_msg) takes only inline payloads; named by module, it did not."""
    from stealer.agents.message import encode_message
    from stealer.shared._layout import INLINE

    data, bufs = encode_message(0x7FFF_FFFF_0001_0000, "act", (np.zeros(2, np.float32),),
                                None, 0x7FFF_FFFF_0002_0000, None)
    assert not bufs and len(data) <= INLINE, len(data)


@pytest.mark.parametrize("a", [
    np.asfortranarray(np.ones((3, 4))),  # not C-contiguous
    np.arange(10.0)[::2],  # a strided view
    np.zeros(3, dtype=[("x", "f4"), ("y", "i2")]),  # structured: dtype.str drops the names
    np.array(["ab", "c"]),  # strings
    np.array([None, 1], dtype=object),
    np.ma.masked_array([1.0, 2.0], mask=[0, 1]),  # a subclass
    np.zeros(serialize.INBAND_MAX // 8 + 1),  # large: out of band, as before
], ids=["fortran", "strided", "structured", "str", "object", "masked", "large"])
def test_other_arrays_take_numpy_s_own_way(a):
    data, bufs = serialize.dumps((a,))
    assert b"_small_array" not in data
    back = pickle.loads(data, buffers=bufs)[0]
    assert type(back) is type(a) and back.dtype == a.dtype and back.shape == a.shape
    assert np.array_equal(np.asarray(back), np.asarray(a))


def test_arrays_deeper_than_two_levels_still_pickle():
    obj = ((({"k": np.ones(2)},),),)
    assert pickle.loads(serialize.dumps(obj)[0])[0][0][0]["k"].tolist() == [1.0, 1.0]


def test_a_small_array_beside_a_lambda_falls_back_to_cloudpickle():
    k = 2
    data, _ = serialize.dumps((np.ones(2), lambda x: x * k))
    a, f = pickle.loads(data)
    assert a.tolist() == [1.0, 1.0] and f(3) == 6


def test_serialize_never_imports_numpy():
    import subprocess
    import sys

    code = ("import sys; from stealer.shared import serialize as s; "
            "s.dumps((1, [2.0], 'x')); assert 'numpy' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
