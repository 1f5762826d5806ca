"""An S3 server on loopback (moto's server mode, in this process), shared by the demo, the benchmarks and
the tests (tests/conftest.py names it ``S3Server``), and the clean environment the demo's and the
benchmarks' pytest subprocesses start from.

The demo and the benchmarks import it as ``local_s3`` (its folder on ``sys.path``); the tests import it
as ``demo.local_s3`` (the repository root is on ``sys.path`` when pytest runs from it)."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any

# Settings of the calling shell that must not leak into a measured run.
STRIPPED_PREFIXES = ("MEGACACHE_", "AWS_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TRITON_")
STRIPPED_NAMES = {"PYTEST_ADDOPTS", "PYTEST_PLUGINS", "OMP_NUM_THREADS"}

# The static credentials and region moto accepts; what boto3 needs besides the endpoint.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def clean_env() -> dict[str, str]:
    """This process's environment without the settings above."""
    return {k: v for k, v in os.environ.items() if not k.startswith(STRIPPED_PREFIXES) and k not in STRIPPED_NAMES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalS3:
    """moto's S3 server on 127.0.0.1 and clients for it; a context manager (or ``start()``/``stop()``).

    Constructing it needs moto's server (``moto[server]``) and raises ImportError without it."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def start(self) -> LocalS3:
        # moto's server logs every request through werkzeug; callers report what matters themselves.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.url, region_name=S3_ENV["AWS_DEFAULT_REGION"],
                            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                            config=Config(max_pool_connections=16))

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (named ``mc-<random>`` when no name is given) and return its name."""
        name = name or f"mc-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def new_bucket(self) -> str:
        """A fresh bucket with a random name."""
        return self.create_bucket()

    def objects(self, bucket: str, prefix: str = "") -> list[tuple[str, int]]:
        """Every (key, size) under prefix, sorted by key, over all pages of the listing."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted((o["Key"], int(o["Size"])) for page in pages for o in page.get("Contents", []))

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under prefix, sorted."""
        return [key for key, _ in self.objects(bucket, prefix)]

    def env(self, no_aws_files: str | None = None) -> dict[str, str]:
        """What a process needs to reach this server through boto3's own settings: endpoint, credentials,
        region. With ``no_aws_files`` (a path with no AWS config in it, e.g. os.devnull) it also never reads
        ~/.aws nor asks the EC2 metadata service."""
        env = {**S3_ENV, "AWS_ENDPOINT_URL_S3": self.url}
        if no_aws_files is not None:
            env.update({"AWS_CONFIG_FILE": no_aws_files, "AWS_SHARED_CREDENTIALS_FILE": no_aws_files,
                        "AWS_EC2_METADATA_DISABLED": "true"})
        return env
