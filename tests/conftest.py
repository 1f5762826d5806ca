"""Shared fixtures: a real S3 endpoint (moto's server mode on 127.0.0.1) and helpers to reach it."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest_plugins = ["pytester"]

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """A moto S3 server over HTTP on loopback, shared by the test session."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def new_bucket(self) -> str:
        name = f"mc-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that should reach this server through boto3's own settings."""
        return {**S3_ENV, "AWS_ENDPOINT_URL_S3": self.url}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    server.server.start()
    try:
        yield server
    finally:
        server.server.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with this process's environment pointing boto3 at it."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "MEGACACHE_BUCKET", "MEGACACHE_DIR"):
        monkeypatch.delenv(key, raising=False)
    return s3_server


@pytest.fixture(autouse=True)
def _clean_megacache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hermetic: no settings, scope or fork detection leaking in from the machine (or from GitHub Actions).
    for key in list(os.environ):
        if key.startswith(("MEGACACHE_", "GITHUB_", "TORCH_COMPILE_JOB_ID")):
            monkeypatch.delenv(key)


def fake_elf(payload: bytes = b"") -> bytes:
    """A whole (if useless) 64-bit ELF file: its header declares no tables, so any length >= 64 is complete.
    Kernel files (.so) the plugin carries must be whole ELF files; truncated ones are refused."""
    header = b"\x7fELF\x02\x01\x01" + bytes(64 - 7)
    return header + payload
