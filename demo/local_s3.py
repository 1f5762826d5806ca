"""An S3 server on loopback (moto's server mode, in this process) for the demo and the benchmarks, and
the clean environment their pytest subprocesses start from."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

# Settings of the calling shell that must not leak into a measured run.
STRIPPED_PREFIXES = ("MEGACACHE_", "AWS_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TRITON_")
STRIPPED_NAMES = {"PYTEST_ADDOPTS", "PYTEST_PLUGINS", "OMP_NUM_THREADS"}


def clean_env() -> dict[str, str]:
    """This process's environment without the settings above."""
    return {k: v for k, v in os.environ.items() if not k.startswith(STRIPPED_PREFIXES) and k not in STRIPPED_NAMES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalS3:
    """moto's S3 server on 127.0.0.1 and clients for it; a context manager."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def __enter__(self) -> LocalS3:
        # moto's server logs every request through werkzeug; the callers print what matters themselves.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key="testing", config=Config(max_pool_connections=16))

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str) -> list[tuple[str, int]]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted((o["Key"], int(o["Size"])) for page in pages for o in page.get("Contents", []))

    def env(self, no_aws_files: str) -> dict[str, str]:
        """What a subprocess needs to reach this server through boto3's own settings (never ~/.aws)."""
        return {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": no_aws_files,
                "AWS_SHARED_CREDENTIALS_FILE": no_aws_files, "AWS_EC2_METADATA_DISABLED": "true"}
