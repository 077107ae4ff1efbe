"""One way to reach data on a local disk or an S3-compatible store (AWS, MinIO, moto).

pyarrow's S3FileSystem ignores AWS_ENDPOINT_URL*, so the endpoint is resolved here; timeouts and
retries are kept small so that a wrong endpoint or bucket fails in seconds instead of hanging a run.
Credentials come from the usual AWS variables/profiles and never appear in messages or logs.
"""

from __future__ import annotations

import functools
import os
import posixpath
from urllib.parse import urlparse

import pyarrow.fs as pafs

S3_PREFIX = "s3://"


class StorageError(RuntimeError):
    """A location cannot be reached or does not exist; the message names the URI."""


def is_s3(uri: str) -> bool:
    return uri.startswith(S3_PREFIX)


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or s3:// URI (always with '/')."""
    return posixpath.join(uri.rstrip("/"), *parts) if is_s3(uri) else os.path.join(uri, *parts)


def resolve_endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint to use: the argument, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (else AWS)."""
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


@functools.lru_cache(maxsize=16)
def _s3_filesystem(
    endpoint_url: str | None, region: str, access_key: str | None, secret_key: str | None, session_token: str | None
) -> pafs.S3FileSystem:
    kwargs: dict = dict(
        region=region,
        connect_timeout=2,
        request_timeout=30,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3),
    )
    if endpoint_url:
        parsed = urlparse(endpoint_url if "://" in endpoint_url else f"https://{endpoint_url}")
        kwargs.update(endpoint_override=parsed.netloc, scheme=parsed.scheme or "https")
    if access_key and secret_key:
        kwargs.update(access_key=access_key, secret_key=secret_key, session_token=session_token)
    return pafs.S3FileSystem(**kwargs)


def open_fs(uri: str, endpoint_url: str | None = None) -> tuple[pafs.FileSystem, str]:
    """Return (filesystem, path inside it) for a local path or s3://bucket/prefix."""
    if is_s3(uri):
        path = uri[len(S3_PREFIX) :].strip("/")
        if not path:
            raise ValueError(f"S3 URI has no bucket: {uri!r}")
        env = os.environ
        fs = _s3_filesystem(
            resolve_endpoint(endpoint_url),
            env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            env.get("AWS_ACCESS_KEY_ID"),
            env.get("AWS_SECRET_ACCESS_KEY"),
            env.get("AWS_SESSION_TOKEN"),
        )
        return fs, path
    if "://" in uri:
        raise ValueError(f"unsupported URI scheme (use a local path or s3://): {uri!r}")
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def _to_uri(uri: str, path: str) -> str:
    return S3_PREFIX + path if is_s3(uri) else path


def list_files(uri: str, suffixes: tuple[str, ...] | list[str] = (), endpoint_url: str | None = None) -> list[str]:
    """All files under uri (recursively) whose name ends with one of suffixes, sorted, as full URIs.

    A uri that names a single file is returned as-is (if it matches)."""
    fs, path = open_fs(uri, endpoint_url)
    suffixes = tuple(suffixes)
    try:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            infos = [info]
        elif info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        else:
            raise StorageError(f"does not exist: {uri}")
    except OSError as e:
        raise StorageError(f"cannot list {uri}: {e}") from e
    paths = [i.path for i in infos if i.type == pafs.FileType.File and (not suffixes or i.path.endswith(suffixes))]
    return sorted(_to_uri(uri, p) for p in paths)


def check_reachable(uri: str, endpoint_url: str | None = None, must_exist: bool = True) -> None:
    """Fail fast with StorageError if the endpoint is unreachable or the location is missing.

    must_exist=False is for outputs: on S3 only the bucket has to exist, locally nothing is checked."""
    fs, path = open_fs(uri, endpoint_url)
    if not must_exist and not is_s3(uri):
        return
    bucket = path.split("/", 1)[0]
    try:
        if is_s3(uri) and fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise StorageError(f"bucket {bucket!r} does not exist: {uri}")
        if must_exist and fs.get_file_info(path).type == pafs.FileType.NotFound:
            raise StorageError(f"does not exist: {uri}")
    except OSError as e:
        endpoint = resolve_endpoint(endpoint_url) or "default AWS endpoint"
        raise StorageError(f"cannot reach {uri} (endpoint {endpoint}): {e}") from e


def write_bytes(uri: str, data: bytes, endpoint_url: str | None = None) -> None:
    fs, path = open_fs(uri, endpoint_url)
    if not is_s3(uri):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with fs.open_output_stream(path) as f:
            f.write(data)
    except OSError as e:
        raise StorageError(f"cannot write {uri}: {e}") from e


def read_bytes(uri: str, endpoint_url: str | None = None) -> bytes:
    fs, path = open_fs(uri, endpoint_url)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except OSError as e:
        raise StorageError(f"cannot read {uri}: {e}") from e
