"""An S3 server on 127.0.0.1 for cluster tests (moto), and uploading a prepared dataset to it.

moto accepts any signed request but refuses anonymous ones to a private bucket, so a pod that
reads a private bucket proves it was given credentials. (To be replaced by the shared S3
fixtures of tests/stores.py.)"""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def s3_server():
    """Yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def upload(endpoint: str, local: str, bucket: str, prefix: str, public: bool = False) -> str:
    """Copy a local folder to s3://bucket/prefix (private unless `public`); returns that URI."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1")
    try:
        s3.create_bucket(Bucket=bucket, **({"ACL": "public-read"} if public else {}))
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    for folder, _, files in os.walk(local):
        for name in files:
            path = os.path.join(folder, name)
            s3.upload_file(path, bucket, f"{prefix}/{os.path.relpath(path, local)}",
                           ExtraArgs={"ACL": "public-read"} if public else None)
    return f"s3://{bucket}/{prefix}"
