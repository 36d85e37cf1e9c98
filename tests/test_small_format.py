"""The small format of calls and results (stealer/shared/serialize.py): the native encoder and
decoder (stealer._cqueues) against the Python reference, both against pickle as the oracle
(hypothesis), and corrupt input refused with a clear error."""

from __future__ import annotations

import math
import pickle
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stealer.shared import serialize

try:
    from stealer import _cqueues
except ImportError:  # pragma: no cover - depends on the build
    _cqueues = None

native = pytest.mark.skipif(_cqueues is None, reason="native extension not built")

# Values the format takes, and values it must refuse (pickle carries them instead).
small_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=60).filter(lambda s: len(s.encode("utf-8", "surrogatepass")) <= 255),
    st.binary(max_size=255),
)
other_values = st.one_of(
    st.integers(2**63, 2**80), st.integers(-(2**80), -(2**63) - 1),
    st.binary(min_size=256, max_size=300), st.lists(st.integers(), max_size=3),
    st.tuples(st.integers()), st.just("\udc80"), st.just(1 + 2j), st.just(frozenset()),
)


def same(a, b) -> bool:
    """Equal values of the same type (NaN equal to NaN, -0.0 told from 0.0)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    return a == b


def encoders():
    yield serialize.encode_small, serialize.encode_small_call
    if _cqueues is not None:
        yield _cqueues.encode_small, _cqueues.encode_small_call


def decoders():
    yield serialize.load_value, serialize.load_call
    if _cqueues is not None:
        yield _cqueues.load_value, _cqueues.load_call


@settings(max_examples=400, deadline=None)
@given(small_values)
def test_small_values_round_trip_through_every_encoder_and_decoder(v):
    blobs = [enc(v) for enc, _ in encoders()]
    assert blobs[0] is not None and blobs[0][0] == serialize.SMALL
    assert all(b == blobs[0] for b in blobs), "native and reference encodings differ"
    for dec, _ in decoders():
        assert same(dec(blobs[0]), pickle.loads(pickle.dumps(v, 5)))


@settings(max_examples=200, deadline=None)
@given(other_values)
def test_other_values_are_refused_and_pickles_still_load(v):
    for enc, _ in encoders():
        assert enc(v) is None
    p = pickle.dumps(v, 5)
    for dec, _ in decoders():
        assert dec(p) == v


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(small_values, max_size=12))
def test_small_calls_round_trip(fref, args):
    args = tuple(args)
    blobs = [enc(fref, args) for _, enc in encoders()]
    assert all(b == blobs[0] for b in blobs)
    for _, dec in decoders():
        f2, a2, kw = dec(blobs[0])
        assert f2 == fref and kw is None and len(a2) == len(args)
        assert all(same(x, y) for x, y in zip(a2, args, strict=True))
    # the native submit writes the call only if it fits the record (limit)
    for _, enc in encoders():
        assert enc(fref, args, len(blobs[0]) - 1) is None
        assert enc(fref, args, len(blobs[0])) == blobs[0]


@pytest.mark.parametrize("fref, args", [
    (-1, ()), (2**32, ()), ("f", ()), (1.0, ()), (True, ()),
    (0, (2**64,)), (0, ([],)), (0, tuple(range(256))),
])
def test_calls_without_a_small_form(fref, args):
    for _, enc in encoders():
        assert enc(fref, args) is None


@pytest.mark.parametrize("blob", [
    b"\x01", b"\x01\x09", b"\x01\x03\x00", b"\x01\x05\x05ab", b"\x01\x00\x00",
    b"\x01\x04" + b"\x00" * 7,
])
def test_corrupt_small_results_are_refused(blob):
    for load_value, _ in decoders():
        with pytest.raises(ValueError, match="corrupt small payload"):
            load_value(blob)


@pytest.mark.parametrize("blob", [
    b"\x01\x00\x00", b"\x01\x00\x00\x00\x00\x01", b"\x01\x00\x00\x00\x00\x00\x00",
    b"\x01\x00\x00\x00\x00\x02\x00",
])
def test_corrupt_small_calls_are_refused(blob):
    for _, load_call in decoders():
        with pytest.raises(ValueError, match="corrupt small payload"):
            load_call(blob)


def test_the_worker_result_is_small_or_an_in_band_pickle():
    import numpy as np

    assert serialize.dump_result(5) == serialize.encode_small(5)
    assert pickle.loads(serialize.dump_result([1, 2])) == [1, 2]
    with pytest.raises(serialize._HasBuffers):
        serialize.dump_result(np.arange(1000))  # an out-of-band buffer: the worker re-pickles
    small = np.arange(10)  # up to serialize.INBAND_MAX bytes: in the pickle itself
    assert np.array_equal(pickle.loads(serialize.dump_result(small)), small)
