"""A compile's or an import's progress: a `Reporter` that the work tells its phase and what it has done, and
the places that shows it (`LogLines`: the machine-readable lines of `contract.CompileProgress` on stdout,
which the operator reads from the compile pod's log; `Console`: a bar on a terminal, plain lines otherwise).

Each sink is sent an update at most every `interval` seconds, and always on a phase change, when a phase
reaches its totals and at the end, so that a fast loop of `advance` calls costs little. The reporter is
thread-safe: a downloader's worker threads may call `on_progress` while the main thread works.
Standard library only (no torch): `neuronfleet up` shows progress without loading model code.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TextIO

from neuronfleet.contract import CompileProgress, progress_text


class Sink(Protocol):
    interval: float  # the least seconds between two updates it is sent (forced ones aside)

    def show(self, progress: CompileProgress, final: bool) -> None: ...


class Reporter:
    """The current phase, the bytes and files it has done of its totals (None: unknown), and the seconds since
    the reporter was made, sent to each sink at its own rate."""

    def __init__(self, *sinks: Sink, clock: Callable[[], float] = time.monotonic) -> None:
        self.sinks = sinks
        self._clock = clock
        self._started = clock()
        self._lock = threading.RLock()  # (sinks are sent updates under it: one at a time)
        self._sent: dict[int, float] = {}  # sink index -> when it was last sent an update
        self._state = CompileProgress(phase="start")
        self._phased = False

    def snapshot(self) -> CompileProgress:
        with self._lock:
            return self._state.model_copy(update={"elapsed": self._clock() - self._started})

    def phase(self, name: str, total_bytes: int | None = None, total_files: int | None = None) -> None:
        """A new phase starts (download, convert, compile, validate), with its totals where known."""
        with self._lock:
            self._phased = True
            self._state = CompileProgress(
                phase=name,
                bytesDone=0 if total_bytes is not None else None,
                bytesTotal=total_bytes,
                filesDone=0 if total_files is not None else None,
                filesTotal=total_files,
            )
        self._send(force=True)

    def advance(self, bytes: int = 0, files: int = 0) -> None:
        """The current phase did `bytes` and `files` more."""
        with self._lock:
            s = self._state
            self._state = s.model_copy(
                update={
                    "bytesDone": (s.bytesDone or 0) + bytes if bytes or s.bytesDone is not None else None,
                    "filesDone": (s.filesDone or 0) + files if files or s.filesDone is not None else None,
                }
            )
        self._send(force=False)

    def on_progress(
        self, bytes_done: int, bytes_total: int | None, files_done: int | None, files_total: int | None
    ) -> None:
        """Where the current phase stands (absolute counts, e.g. a downloader's callback)."""
        with self._lock:
            self._state = self._state.model_copy(
                update={
                    "bytesDone": bytes_done,
                    "bytesTotal": bytes_total,
                    "filesDone": files_done,
                    "filesTotal": files_total,
                }
            )
        self._send(force=False)

    def finish(self) -> None:
        """The work is done: every sink is sent the last update (a bar ends its line)."""
        if self._phased:
            self._send(force=True, final=True)

    def _send(self, force: bool, final: bool = False) -> None:
        with self._lock:
            progress = self.snapshot()
            p = progress
            done = (p.bytesTotal is not None and (p.bytesDone or 0) >= p.bytesTotal) or (
                p.filesTotal is not None and (p.filesDone or 0) >= p.filesTotal
            )
            now = self._clock()
            for i, sink in enumerate(self.sinks):
                last = self._sent.get(i)
                if force or done or last is None or now - last >= sink.interval:
                    self._sent[i] = now
                    sink.show(progress, final)


class LogLines:
    """The machine-readable progress lines (`CompileProgress.line`) on a stream, flushed at once: a pod's
    stdout is a pipe, and the operator reads the log while the compile runs."""

    def __init__(self, stream: TextIO | None = None, interval: float = 2.0) -> None:
        self.stream, self.interval = stream or sys.stdout, interval
        self._last: CompileProgress | None = None

    def show(self, progress: CompileProgress, final: bool) -> None:
        unchanged = self._last is not None and self._last.model_copy(update={"elapsed": 0}) == (
            progress.model_copy(update={"elapsed": 0})
        )
        if unchanged and not final:
            return  # nothing new to say (the reader knows the time itself)
        self._last = progress
        print(progress.line(), file=self.stream, flush=True)


BAR_WIDTH = 24


def bar(progress: CompileProgress, width: int = BAR_WIDTH) -> str:
    """`convert  [#########---------------] 35% 96/270MB 12s` (no bar when no total is known)."""
    done, total = progress.bytesDone, progress.bytesTotal
    if not total and progress.filesTotal:
        done, total = progress.filesDone, progress.filesTotal
    text = progress_text(progress)
    if not total:
        return text
    filled = min(width, (done or 0) * width // total)
    name, _, rest = text.partition(" ")
    return f"{name:<8} [{'#' * filled}{'-' * (width - filled)}] {rest}"


class Console:
    """For a person: on a terminal, one bar redrawn in place (a new line per phase); otherwise a plain line
    per update every `plain_interval` seconds (a log file or a pipe gets no carriage returns)."""

    def __init__(self, stream: TextIO | None = None, plain_interval: float = 10.0, label: str = "") -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.2 if self.tty else plain_interval
        self.label = f"[{label}] " if label else ""
        self._phase: str | None = None

    def show(self, progress: CompileProgress, final: bool) -> None:
        if not self.tty:
            print(self.label + progress_text(progress), file=self.stream, flush=True)
            return
        if self._phase is not None and self._phase != progress.phase:
            self.stream.write("\n")
        self._phase = progress.phase
        self.stream.write("\r\x1b[2K" + self.label + bar(progress) + ("\n" if final else ""))
        self.stream.flush()


PARTIAL_SUFFIX = ".incomplete"  # what huggingface_hub names a blob while it downloads it


def folder_size(folder: Path) -> tuple[int, int]:
    """(bytes, files) of the regular files under `folder` (symbolic links not followed): bytes of every file,
    partial ones included; files: the complete ones (not ending in PARTIAL_SUFFIX)."""
    size = files = 0
    for path in folder.rglob("*"):
        try:
            if path.is_symlink() or not path.is_file():
                continue
            size += path.stat().st_size
        except FileNotFoundError:  # renamed or removed while we looked
            continue
        files += not path.name.endswith(PARTIAL_SUFFIX)
    return size, files


@contextlib.contextmanager
def watch_folder(
    folder: Path,
    on_progress: Callable[[int, int | None, int | None, int | None], None],
    total_bytes: int | None = None,
    total_files: int | None = None,
    interval: float = 1.0,
) -> Iterator[None]:
    """While the body runs, report what has arrived in `folder` every `interval` seconds and once at the end
    (`on_progress(bytes_done, bytes_total, files_done, files_total)`): for a download that reports nothing
    itself, such as huggingface_hub's snapshot into its cache folder. What has arrived only grows: a read of
    the folder can miss a file being renamed (its partial name gone, its final one not yet listed), so a
    report never goes below the one before."""
    stop = threading.Event()
    most = [0, 0]  # bytes and files reported so far

    def report() -> None:
        size, files = folder_size(folder)
        most[0], most[1] = max(most[0], size), max(most[1], files)
        on_progress(most[0], total_bytes, most[1], total_files)

    def poll() -> None:
        while not stop.wait(interval):
            report()

    poller = threading.Thread(target=poll, name="watch-folder", daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join()
    report()
