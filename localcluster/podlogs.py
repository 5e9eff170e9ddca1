"""Pod logs as a node writes and serves them: each container instance's stdout and stderr go, line by line, to
its own file in the CRI log format (`<RFC3339Nano time> <stream> <F|P> <content>`, what containerd writes
under /var/log/pods), and `kubectl logs` reads them back with the kubelet's options: tailLines (counted on
the file's lines, before sinceSeconds/sinceTime, as the kubelet does), sinceSeconds, sinceTime, timestamps
(each line prefixed with its time in RFC3339NanoFixed), limitBytes, and follow.

Kubernetes' reader: pkg/kubelet/kuberuntime/logs/logs.go (parseCRILog, logWriter.write, ReadLogs;
timeFormatOut is types.RFC3339NanoFixed). Everything but `copy_lines` and `follow` is pure.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .semantics import ApiError

MAX_LINE = 16 * 1024  # a longer line is written as partial (P) pieces, as containerd does
FOLLOW_POLL = 0.2  # seconds between looks at a followed file


def format_time(ns: int) -> str:
    """RFC3339NanoFixed in UTC: 2024-01-02T03:04:05.000000001Z."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    whole = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{whole}.{nanos:09d}Z"


def parse_time(text: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 time with any fraction (what the API's sinceTime and the
    CRI log's timestamps carry)."""
    text = text.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    main, _, rest = text.partition(".")
    fraction, offset = "", ""
    if rest:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        fraction, offset = rest[:digits], rest[digits:]
    else:
        main, offset = main[:19], main[19:]
    try:
        base = datetime.datetime.fromisoformat(main + (offset or "+00:00"))
    except ValueError:
        raise ApiError(400, "BadRequest", f"{text!r} is not an RFC 3339 time") from None
    return int(base.timestamp()) * 1_000_000_000 + int((fraction + "000000000")[:9])


def cri_line(stream: str, content: bytes, partial: bool, at_ns: int) -> bytes:
    """One line of a CRI log file (content without its newline)."""
    tag = b"P" if partial else b"F"
    return b"%s %s %s %s\n" % (format_time(at_ns).encode(), stream.encode(), tag, content)


@dataclass
class Entry:
    at_ns: int
    stream: str
    content: bytes  # with its newline for a full line, without for a partial one


def parse_line(line: bytes) -> Entry | None:
    """A CRI log line (with or without its newline), or None where it is not one."""
    try:
        stamp, stream, tag, content = line.split(b" ", 3)
    except ValueError:
        return None
    if stream not in (b"stdout", b"stderr"):
        return None
    try:
        at = parse_time(stamp.decode())
    except (ApiError, UnicodeDecodeError):
        return None
    content = content.removesuffix(b"\n")
    partial = tag.split(b":")[0] == b"P"
    return Entry(at, stream.decode(), content if partial else content + b"\n")


@dataclass
class LogOptions:
    """The PodLogOptions the kubelet honours, from a log request's query."""

    follow: bool = False
    timestamps: bool = False
    previous: bool = False
    tail: int = -1  # -1: every line
    limit: int = -1  # -1: no byte limit
    since_ns: int = 0
    container: str = ""

    @classmethod
    def from_query(cls, query: dict[str, str], now_ns: int | None = None) -> LogOptions:
        def flag(name: str) -> bool:
            return query.get(name, "false").lower() in ("true", "1")

        def number(name: str, least: int) -> int | None:
            raw = query.get(name)
            if raw is None:
                return None
            try:
                value = int(raw)
            except ValueError:
                raise ApiError(400, "BadRequest", f"{name} must be an integer, not {raw!r}") from None
            if value < least:
                raise ApiError(422, "Invalid", f"{name}: Invalid value: {value}: must be at least {least}")
            return value

        now_ns = time.time_ns() if now_ns is None else now_ns
        options = cls(follow=flag("follow"), timestamps=flag("timestamps"), previous=flag("previous"))
        options.container = query.get("container", "")
        tail = number("tailLines", 0)
        options.tail = -1 if tail is None else tail
        limit = number("limitBytes", 1)
        options.limit = -1 if limit is None else limit
        since = number("sinceSeconds", 1)
        if since is not None and "sinceTime" in query:
            raise ApiError(422, "Invalid", "at most one of `sinceTime` or `sinceSeconds` may be specified")
        if since is not None:
            options.since_ns = now_ns - since * 1_000_000_000
        if "sinceTime" in query:
            options.since_ns = parse_time(query["sinceTime"])
        return options


def render(entries: list[Entry], options: LogOptions) -> tuple[bytes, int]:
    """What the kubelet writes for these entries under the options (since and timestamps; the byte limit
    counted from `options.limit`), and how many bytes of the limit are left (-1: no limit)."""
    out = bytearray()
    left = options.limit
    for entry in entries:
        if entry.at_ns < options.since_ns:
            continue
        line = entry.content
        if options.timestamps:
            line = format_time(entry.at_ns).encode() + b" " + line
        if left >= 0:
            line = line[:left]
            left -= len(line)
        out += line
        if left == 0:
            break
    return bytes(out), left


def select(data: bytes, options: LogOptions) -> tuple[bytes, int]:
    """The kubelet's answer for a whole log file's bytes: the last `tail` lines, then since, timestamps and
    limit; and how many bytes of `data` it used (not a trailing line without its newline: a follower's)."""
    lines = data.split(b"\n")
    rest = lines.pop()  # after the last newline: an unfinished line (or b"")
    if options.tail >= 0:
        lines = lines[len(lines) - options.tail :] if options.tail else []
    entries = [e for e in (parse_line(line) for line in lines) if e is not None]
    out, _ = render(entries, options)
    return out, len(data) - len(rest)


async def copy_lines(reader: asyncio.StreamReader, stream: str, out: BinaryIO) -> None:
    """Copy a process's stream to its CRI log file, one timestamped line at a time, until end of file."""
    buffer = b""
    while True:
        chunk = await reader.read(1 << 16)
        if not chunk:
            break
        buffer += chunk
        lines = buffer.split(b"\n")
        buffer = lines.pop()
        now_ns = time.time_ns()
        for line in lines:
            out.write(cri_line(stream, line, False, now_ns))
        while len(buffer) > MAX_LINE:
            out.write(cri_line(stream, buffer[:MAX_LINE], True, now_ns))
            buffer = buffer[MAX_LINE:]
        out.flush()
    if buffer:
        out.write(cri_line(stream, buffer, True, time.time_ns()))
        out.flush()


async def follow(path: Path, options: LogOptions, writing: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The log under the options, then (following) what is appended while `writing()` holds (the container
    instance runs and its streams are open), ending after the last line once it no longer does; while
    following, an empty chunk now and then."""
    with path.open("rb") as f:
        data = f.read()
        out, used = select(data, options)
        f.seek(used)
        left = options.limit
        if out:
            yield out
            if left >= 0:
                left -= len(out)
        while options.follow and left != 0:
            done = not writing()  # looked at before reading, so nothing written before the end is missed
            chunk = f.read()
            lines = chunk.split(b"\n")
            rest = lines.pop()
            f.seek(-len(rest), 1)
            entries = [e for e in (parse_line(line) for line in lines) if e is not None]
            out, left = render(entries, LogOptions(**{**options.__dict__, "limit": left}))
            yield out  # empty when nothing came: the reader looks whether its client is still there
            if done:
                return
            await asyncio.sleep(FOLLOW_POLL)
