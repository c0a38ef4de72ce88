"""The parent's reads of a worker's pipe (``_senders.FrameReader``): whole frames, however the
bytes arrive, read into one buffer kept per thread; and results of every size through a Pool."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

import jaxtransport as jt
from jaxtransport import _os
from jaxtransport.pool import _senders
from jaxtransport.pool._framing import pieces


def _pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    return a, b


def _frames(*payloads: bytes) -> bytes:
    return b"".join(bytes(p) for p in pieces(list(payloads)))


def test_many_small_frames_in_one_read_come_out_whole_and_in_order():
    a, b = _pair()
    try:
        reader = _senders.FrameReader(a)
        payloads = [os.urandom(n) for n in (0, 1, 3, 100, 5000, 70_000)]
        b.sendall(_frames(*payloads))
        got: list[bytes] = []
        while len(got) < len(payloads):
            frames, eof = reader.read()
            assert not eof
            got += frames
        assert got == payloads
        assert reader.read() == ([], False)
    finally:
        a.close()
        b.close()


def test_a_frame_split_anywhere_waits_for_its_rest():
    a, b = _pair()
    try:
        reader = _senders.FrameReader(a)
        payload = os.urandom(1000)
        data = _frames(payload, b"tail")
        for cut in (1, 3, 4, 5, 500, len(data) - 1):
            b.sendall(data[:cut])
            first, eof = reader.read()
            b.sendall(data[cut:])
            rest, eof2 = reader.read()
            assert not eof and not eof2
            assert first + rest == [payload, b"tail"], cut
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("size", [(64 << 10) - 4, 64 << 10, (1 << 20) + 17, 3 << 20])
def test_a_frame_larger_than_the_first_buffer_is_read_whole(size):
    """The first read goes into a 64 KiB buffer; a frame that fills it is read on in 1 MiB steps."""
    a, b = _pair()
    try:
        reader = _senders.FrameReader(a)
        payload = os.urandom(size)
        data = _frames(payload)
        writer = threading.Thread(target=b.sendall, args=(data,))
        writer.start()
        got: list[bytes] = []
        while not got:
            _os.wait_readable(a, 5.0)
            frames, eof = reader.read()
            assert not eof
            got += frames
        writer.join(5)
        assert got == [payload]
    finally:
        a.close()
        b.close()


def test_the_buffers_are_one_per_thread_and_reused():
    small = _senders._buffer("small", _senders._SCRATCH)
    assert _senders._buffer("small", _senders._SCRATCH) is small
    other: list = []
    t = threading.Thread(target=lambda: other.append(_senders._buffer("small", _senders._SCRATCH)))
    t.start()
    t.join()
    assert other[0][0] is not small[0]


def test_eof_and_a_negative_length_are_reported():
    a, b = _pair()
    try:
        reader = _senders.FrameReader(a)
        b.sendall(_frames(b"last") + struct.pack("!i", -7) + b"junk")
        b.close()
        frames, eof = reader.read()
        assert frames == [b"last", b""]  # b"": not a frame, the caller reports a corrupt message
        if not eof:  # a short read ends a read; the closed end shows at the next
            frames, eof = reader.read()
            assert frames == []
        assert eof
    finally:
        a.close()


def _blob(n: int) -> bytes:
    return bytes(range(256)) * (n // 256) + bytes(n % 256)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_results_of_every_size_through_a_pool_match_the_stock_pool(method):
    import multiprocessing

    sizes = [0, 10, 65_531, 65_536, 200_000, 1 << 20, (3 << 20) + 5]
    with jt.Pool(2, start_method=method, preload_jax=False) as pool:
        ours = pool.map(_blob, sizes, chunksize=1)
        async_ours = [pool.apply_async(_blob, (n,)) for n in reversed(sizes)]
        assert [r.get(60) for r in async_ours] == [_blob(n) for n in reversed(sizes)]
    with multiprocessing.get_context(method).Pool(2) as stock:
        assert ours == stock.map(_blob, sizes, chunksize=1)
