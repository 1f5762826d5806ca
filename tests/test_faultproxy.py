"""The fault-injection proxy (tests/faultproxy.py) in front of the real moto server, driven by boto3 with short
timeouts and no retries: each mode does what it says, and stop() is prompt and leaves nothing running."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from .conftest import S3Server
from .faultproxy import FaultProxy


def _client(url: str, attempts: int = 1) -> Any:
    import boto3

    config = Config(connect_timeout=1, read_timeout=2, retries={"total_max_attempts": attempts})
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing", config=config)


def _proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("faultproxy-")]


def _assert_nothing_left() -> None:
    deadline = time.monotonic() + 1.0
    while _proxy_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _proxy_threads() == []
    assert [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()] == []


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.url, trickle_bytes_per_second=20) as p:
        yield p
    _assert_nothing_left()


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()


def test_pass_through_round_trip(proxy: FaultProxy, s3_server: S3Server) -> None:
    client = _client(proxy.url)
    name = "mc-proxy-" + str(time.monotonic_ns())[-12:]
    client.create_bucket(Bucket=name)
    client.put_object(Bucket=name, Key="a/one.mcb", Body=b"payload" * 1000)
    client.put_object(Bucket=name, Key="a/two.mcb", Body=b"")
    listing = client.list_objects_v2(Bucket=name, Prefix="a/")
    assert sorted((o["Key"], o["Size"]) for o in listing["Contents"]) == [("a/one.mcb", 7000), ("a/two.mcb", 0)]
    assert client.head_object(Bucket=name, Key="a/one.mcb")["ContentLength"] == 7000
    assert client.get_object(Bucket=name, Key="a/one.mcb")["Body"].read() == b"payload" * 1000
    assert client.get_object(Bucket=name, Key="a/two.mcb")["Body"].read() == b""
    with pytest.raises(ClientError) as missing:
        client.get_object(Bucket=name, Key="a/none.mcb")
    assert missing.value.response["Error"]["Code"] == "NoSuchKey"
    client.delete_object(Bucket=name, Key="a/one.mcb")
    assert s3_server.keys(name) == ["a/two.mcb"]

    methods = [method for method, _, _ in proxy.requests]
    assert methods == ["PUT", "PUT", "PUT", "GET", "HEAD", "GET", "GET", "GET", "DELETE"]
    assert {mode for _, _, mode in proxy.requests} == {None}
    assert ("GET", f"/{name}/a/one.mcb", None) in proxy.requests


def test_mode_is_checked() -> None:
    p = FaultProxy("http://127.0.0.1:9")
    for mode in FaultProxy.MODES:
        p.mode = mode
        assert p.mode == mode
    with pytest.raises(ValueError, match="unknown mode"):
        p.mode = "slow"
    p.stop()  # never started: a no-op


def test_503_answers_at_once_without_upstream(proxy: FaultProxy, s3_server: S3Server, bucket: str) -> None:
    proxy.mode = "503"
    client = _client(proxy.url)
    with pytest.raises(ClientError) as put:
        client.put_object(Bucket=bucket, Key="k.mcb", Body=b"x" * 100)
    assert put.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert put.value.response["Error"]["Code"] == "SlowDown"
    with pytest.raises(ClientError) as listing:
        client.list_objects_v2(Bucket=bucket, Prefix="k")
    assert listing.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert proxy.requests == [("PUT", f"/{bucket}/k.mcb", "503"),
                              ("GET", f"/{bucket}?list-type=2&prefix=k&encoding-type=url", "503")]

    # botocore retries a 503 (SlowDown is a throttling code): total_max_attempts=3 is three requests.
    del proxy.requests[:]
    with pytest.raises(ClientError) as retried:
        _client(proxy.url, attempts=3).put_object(Bucket=bucket, Key="k.mcb", Body=b"x")
    assert retried.value.response["ResponseMetadata"]["RetryAttempts"] == 2
    assert proxy.requests == [("PUT", f"/{bucket}/k.mcb", "503")] * 3
    assert s3_server.keys(bucket) == []


def test_reset_put_resets_and_stores_nothing(proxy: FaultProxy, s3_server: S3Server, bucket: str) -> None:
    proxy.mode = "reset-put"
    client = _client(proxy.url)
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        client.put_object(Bucket=bucket, Key="k.mcb", Body=b"x" * 100_000)
    assert client.list_objects_v2(Bucket=bucket)["KeyCount"] == 0  # other requests pass through
    assert s3_server.keys(bucket) == []
    assert proxy.requests == [("PUT", f"/{bucket}/k.mcb", "reset-put"),
                              ("GET", f"/{bucket}?list-type=2&encoding-type=url", None)]


def test_trickle_get_delivers_the_body_at_the_trickle_rate(proxy: FaultProxy, s3_server: S3Server, bucket: str) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="k.mcb", Body=bytes(range(100)))
    proxy.mode = "trickle-get"
    client = _client(proxy.url)

    started = time.monotonic()
    response = client.get_object(Bucket=bucket, Key="k.mcb")
    # The head arrives at once: trickled, its ~400 bytes would take ~20 s at 20 B/s.
    assert time.monotonic() - started < 10
    assert response["ContentLength"] == 100
    body = response["Body"]
    got = b""
    while len(got) < 20:
        got += body.read(1)  # each read waits ~1/20 s: far inside read_timeout, which never trips
    took = time.monotonic() - started
    body.close()
    # 20 B/s since the body started, which was after `started`: 20 bytes cannot have come in less than 1 s
    # (the whole 100 at once would take no time), whatever the load.
    assert 0.95 <= took < 30, took
    assert got == bytes(range(20))

    started = time.monotonic()
    assert client.list_objects_v2(Bucket=bucket)["KeyCount"] == 1  # listings are not trickled
    assert client.head_object(Bucket=bucket, Key="k.mcb")["ContentLength"] == 100
    assert time.monotonic() - started < 10  # trickled, their ~1000 bytes of answers would take ~50 s
    assert [mode for _, _, mode in proxy.requests] == ["trickle-get", None, None]


def test_trickle_put_stores_the_object_but_answers_slowly(s3_server: S3Server, bucket: str) -> None:
    rate = 200.0
    with FaultProxy(s3_server.url, trickle_bytes_per_second=rate) as proxy:
        client = _client(proxy.url)
        # The size of a PutObject response from moto (~400 bytes), from a pass-through put.
        headers = client.put_object(Bucket=bucket, Key="first.mcb", Body=b"x")["ResponseMetadata"]["HTTPHeaders"]
        size = len("HTTP/1.1 200 OK\r\n\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items())

        proxy.mode = "trickle-put"
        started = time.monotonic()
        client.put_object(Bucket=bucket, Key="second.mcb", Body=b"y" * 1000)
        elapsed = time.monotonic() - started
        assert elapsed >= 0.8 * size / rate, (elapsed, size)  # ~2 s; the per-read read_timeout never trips
        assert s3_server.keys(bucket) == ["first.mcb", "second.mcb"]
        assert s3_server.client().get_object(Bucket=bucket, Key="second.mcb")["Body"].read() == b"y" * 1000
        assert proxy.requests[-1] == ("PUT", f"/{bucket}/second.mcb", "trickle-put")
    _assert_nothing_left()


def test_blackhole_times_out_and_stop_is_prompt(s3_server: S3Server, bucket: str) -> None:
    with FaultProxy(s3_server.url) as proxy:
        proxy.mode = "blackhole"
        with pytest.raises((ReadTimeoutError, ConnectTimeoutError)):
            _client(proxy.url).list_objects_v2(Bucket=bucket)
        assert proxy.requests == [("GET", f"/{bucket}?list-type=2&encoding-type=url", "blackhole")]
        # A client still connected, half-way through a request, when the proxy stops.
        port = int(proxy.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"PUT /b/k HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
            time.sleep(0.2)
            started = time.monotonic()
            proxy.stop()
            assert time.monotonic() - started < 5  # it joins for 0.8 s at most; a hang would be the open request's
            raw.settimeout(1)
            try:
                assert raw.recv(100) == b""  # the proxy closed its side, and never answered
            except ConnectionResetError:
                pass
    _assert_nothing_left()


def test_stop_with_open_trickles_is_prompt(s3_server: S3Server, bucket: str) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="k.mcb", Body=b"z" * 100)
    proxy = FaultProxy(s3_server.url).start()  # 1 B/s
    proxy.mode = "trickle-get"
    client = _client(proxy.url)
    bodies = [client.get_object(Bucket=bucket, Key="k.mcb")["Body"] for _ in range(3)]
    assert len(_proxy_threads()) == 4  # the acceptor and three trickles

    started = time.monotonic()
    proxy.stop()
    assert time.monotonic() - started < 5  # it joins for 0.8 s at most; a trickle runs 100 s
    proxy.stop()  # again: a no-op
    _assert_nothing_left()
    for body in bodies:  # the trickles were cut off: reads end at once, with an error
        started = time.monotonic()
        with pytest.raises(ResponseStreamingError, match="IncompleteRead"):
            body.read()
        body.close()
        assert time.monotonic() - started < 10  # a trickle left running would take 100 s
