"""The runtime's static peer map, for environments without cluster DNS (the local cluster is one): dns://
names listed there resolve to its addresses, read again at each resolution; other names go to DNS."""

from __future__ import annotations

import json

from neuronfleet.cli import build_parser
from neuronfleet.contract import PEER_HOSTS_FILE_ENV
from neuronfleet.runtime.routing.router import resolve_peers


def test_dns_peers_resolve_through_the_static_map_first(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"decode.default:8000": ["127.0.0.1:41000", "127.0.0.1:41001"]}))
    monkeypatch.setenv(PEER_HOSTS_FILE_ENV, str(hosts))
    assert resolve_peers(["dns://decode.default:8000"]) == [
        "http://127.0.0.1:41000",
        "http://127.0.0.1:41001",
    ]
    assert "http://127.0.0.1:8000" in resolve_peers(["dns://localhost:8000"])  # not in the map: DNS
    hosts.write_text(json.dumps({"decode.default:8000": []}))  # no ready pod now
    assert resolve_peers(["dns://decode.default:8000"]) == []


def test_serve_takes_the_map_as_an_option():
    args = build_parser().parse_args(["serve", "--model", "m", "--role", "router", "--peer-hosts-file", "h"])
    assert args.peer_hosts_file == "h"
