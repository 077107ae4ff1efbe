"""A local S3-compatible server (moto's) for the demo and the tests, and a bucket on it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_s3_server():
    """A moto S3 server on 127.0.0.1 in a subprocess, always stopped on exit. Yields its endpoint
    URL and sets throwaway credentials in this process's environment (moto accepts any)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"local S3 server did not start on {endpoint}")
            time.sleep(0.2)
        for key, value in {
            "AWS_ACCESS_KEY_ID": "local",
            "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            os.environ.setdefault(key, value)
        yield endpoint
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


def create_bucket(endpoint_url: str, bucket: str) -> None:
    import boto3  # only for the local S3 server of the demo and the tests

    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
