"""A real S3 API server for the tests (moto's server mode as a subprocess on a free loopback port, IAM
policies enforced when asked), and a TCP proxy in front of it that cuts downloads in the middle."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from pathlib import Path

import boto3
from support import Process, free_port
from tcp_proxy import TcpProxy

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


class MotoServer(Process):
    """`moto_server` on 127.0.0.1:port. With `iam_setup_requests`, moto enforces IAM policies after that many
    unauthenticated requests (INITIAL_NO_AUTH_ACTION_COUNT, moto's docs "IAM-like Access Control"), which
    `user` spends creating users."""

    def __init__(self, log: Path, iam_setup_requests: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        saved = dict(os.environ)
        if iam_setup_requests is not None:
            os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = str(iam_setup_requests)
        try:
            super().__init__([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p",
                              str(self.port)], log)  # fmt: skip
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.wait_until(self.answers, "moto_server to listen")

    def answers(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True
        return False

    def client(self, service: str = "s3", key: dict | None = None):
        """A boto3 client of this server, with `key` (an IAM access key) or the test keys."""
        return boto3.client(
            service, endpoint_url=self.url, region_name="us-east-1",
            aws_access_key_id=key["AccessKeyId"] if key else KEYS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=key["SecretAccessKey"] if key else KEYS["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip

    def user(self, name: str, policy: dict | None) -> dict:
        """An IAM user with `policy` inline (none: no permission at all) and its access key (3 requests, or 2
        without a policy)."""
        iam = self.client("iam")
        iam.create_user(UserName=name)
        if policy is not None:
            iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
        return iam.create_access_key(UserName=name)["AccessKey"]


def env_of(url: str, key: dict | None = None) -> dict[str, str]:
    """What a pod on EKS would have, as environment variables: credentials (here an access key) and the
    endpoint (AWS_ENDPOINT_URL, which boto3 reads itself)."""
    env = dict(KEYS, AWS_ENDPOINT_URL=url)
    if key:
        env.update(AWS_ACCESS_KEY_ID=key["AccessKeyId"], AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])
    return env


class CuttingProxy(TcpProxy):
    """A TCP proxy in front of the S3 server. While cutting, a connection that has carried a request whose
    bytes hold `marker` (any request for an empty marker) is closed once it has carried `after` bytes back
    to the client from then on: a download cut in the middle. `carried` counts the bytes sent back."""

    def __init__(self, target_port: int) -> None:
        self.after: int | None = None
        self.marker = b""
        self.carried = 0
        self.lock = threading.Lock()
        super().__init__(target_port)

    def cut(self, after: int, marker: bytes = b"") -> None:
        self.after, self.marker = after, marker

    def heal(self) -> None:
        self.after = None
        with self.lock:
            self.carried = 0

    def connection(self) -> threading.Event:
        return threading.Event()  # set once the connection carried a marked request while cutting

    def pump(
        self, src: socket.socket, dst: socket.socket, upstream_bound: bool, marked: threading.Event
    ) -> None:
        if upstream_bound:
            while data := src.recv(65536):
                if self.after is not None and self.marker in data:
                    marked.set()
                dst.sendall(data)
            return
        sent = 0
        while data := src.recv(65536):
            limit = self.after if marked.is_set() else None
            if limit is not None and sent + len(data) > limit:
                dst.sendall(data[: limit - sent])
                return
            dst.sendall(data)
            if marked.is_set():
                sent += len(data)
            with self.lock:
                self.carried += len(data)
