"""A Hugging Face Hub on loopback for the tests that read one: `/{org}/{name}/resolve/{revision}/{file}`
answers as the Hub does (200 with the file, 401 for a gated repository without a token that opens it, 404
for what is not there), and every request is recorded (path, Authorization) so a test sees what was asked
and with which token."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeHub:
    """Files per (repository, revision); a repository in `gated` opens only to its token."""

    def __init__(self) -> None:
        self.files: dict[tuple[str, str], dict[str, bytes]] = {}
        self.gated: dict[str, str] = {}  # repository -> the token that opens it
        self.requests: list[tuple[str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.requests.append((self.path, self.headers.get("Authorization")))
                parts = self.path.lstrip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._answer(404, b'{"error":"Entry not found"}')
                repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                token = hub.gated.get(repo)
                if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                    return self._answer(401, b'{"error":"Access to this model is restricted"}')
                body = hub.files.get((repo, revision), {}).get(name)
                self._answer(200, body) if body is not None else self._answer(404, b'{"error":"not found"}')

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def add_config(self, repo: str, config: dict[str, Any], revision: str = "main") -> None:
        self.files.setdefault((repo, revision), {})["config.json"] = json.dumps(config).encode()

    def asked(self, repo: str) -> list[tuple[str, str | None]]:
        """The requests for a repository's files."""
        return [r for r in self.requests if r[0].startswith(f"/{repo}/")]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
