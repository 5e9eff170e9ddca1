"""Compile progress, pure parts: the progress line both sides share (contract.CompileProgress: written,
parsed back from log tails with garbage, cut and old lines, shown as text), the reporter's throttle and its
sinks (runtime/progress.py), the operator's status from a log tail and its write throttle
(operator/status.py), and the external engines' compile scripts' progress line, run by a real shell."""

from __future__ import annotations

import io
import subprocess

import pytest

from neuronfleet.contract import (
    PROGRESS_PREFIX,
    CompileProgress,
    duration_text,
    parse_progress,
    progress_text,
)
from neuronfleet.operator.engines.common import progress_echo
from neuronfleet.operator.status import compile_progress, compute_status, progress_due
from neuronfleet.runtime.progress import Console, LogLines, Reporter, bar

P = CompileProgress


def line(**fields) -> str:
    return P(**fields).line()


def test_a_line_round_trips():
    p = P(phase="download", bytesDone=5, bytesTotal=10, filesDone=1, filesTotal=2, elapsed=3.25)
    text = p.line()
    assert text.startswith(PROGRESS_PREFIX) and "\n" not in text
    assert parse_progress(text) == p.model_copy(update={"elapsed": 3.2})  # (one decimal on the wire)
    assert parse_progress(line(phase="validate")) == P(phase="validate")


NEWER = line(phase="convert", bytesDone=70, bytesTotal=100)
OLDER = line(phase="convert", bytesDone=10, bytesTotal=100)


@pytest.mark.parametrize(
    "tail, expected",
    [
        ("", None),
        ("loading model\nno progress here\n", None),
        (f"{OLDER}\n{NEWER}\n", P(phase="convert", bytesDone=70, bytesTotal=100)),  # the newest wins
        (f"{OLDER}\n{NEWER}\nsome other output\n", P(phase="convert", bytesDone=70, bytesTotal=100)),
        (f"{OLDER}\n{NEWER[:-9]}", P(phase="convert", bytesDone=10, bytesTotal=100)),  # the last line is cut
        (f"{NEWER[12:]}\n{OLDER}", P(phase="convert", bytesDone=10, bytesTotal=100)),  # first line cut
        (f"{OLDER}\n{PROGRESS_PREFIX}not json\n", P(phase="convert", bytesDone=10, bytesTotal=100)),
        (
            f'{OLDER}\n{PROGRESS_PREFIX}{{"phase":"x","bytesDone":-1}}\n',
            P(phase="convert", bytesDone=10, bytesTotal=100),
        ),
        (f'{PROGRESS_PREFIX}{{"bytesDone":3}}\n', None),  # no phase
        (f'{PROGRESS_PREFIX}{{"phase":"Bad Phase"}}\n', None),
        # a newer compile's field is ignored, an older one's absent fields are unknown
        (
            f'{PROGRESS_PREFIX}{{"phase":"compile","elapsed":7,"neuronCores":2}}\r\n',
            P(phase="compile", elapsed=7),
        ),
        (f'  {PROGRESS_PREFIX}{{"phase":"download"}}', P(phase="download")),
    ],
)
def test_the_newest_whole_line_of_a_tail_is_the_progress(tail, expected):
    assert parse_progress(tail) == expected


@pytest.mark.parametrize(
    "progress, text",
    [
        (
            P(phase="download", bytesDone=1_200_000_000, bytesTotal=3_400_000_000, elapsed=42),
            "download 35% 1.2/3.4GB 42s",
        ),
        (
            P(phase="convert", bytesDone=96_000_000, bytesTotal=270_000_000, elapsed=75),
            "convert 35% 96/270MB 1m15s",
        ),
        (P(phase="convert", bytesDone=512, bytesTotal=512, elapsed=0), "convert 100% 512/512B 0s"),
        (P(phase="download", bytesDone=5_500_000, elapsed=3), "download 5.5MB 3s"),
        (P(phase="download", filesDone=3, filesTotal=12, elapsed=9), "download 3/12 files 9s"),
        (P(phase="compile", elapsed=250), "compile 4m10s"),
        (P(phase="compile", elapsed=3725), "compile 1h02m"),
        (P(phase="convert", bytesDone=0, bytesTotal=0, elapsed=1), "convert 1s"),
    ],
)
def test_the_text_people_read(progress, text):
    assert progress_text(progress) == text


def test_durations():
    assert [duration_text(s) for s in (0, 59.9, 60, 3599, 3600, 86399)] == ["0s", "59s", "1m00s", "59m59s",
                                                                             "1h00m", "23h59m"]  # fmt: skip


class Collect:
    def __init__(self, interval: float) -> None:
        self.interval, self.seen = interval, []

    def show(self, progress, final):
        self.seen.append((progress, final))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_reporter_sends_each_sink_at_its_rate_and_always_phase_changes_and_totals():
    clock, slow, fast = Clock(), Collect(2.0), Collect(0.0)
    r = Reporter(slow, fast, clock=clock)
    r.phase("convert", total_bytes=1000, total_files=1)
    for _ in range(9):  # 9 advances in 0.9 s: the slow sink hears none of them
        clock.t += 0.1
        r.advance(bytes=100)
    assert [p.bytesDone for p, _ in slow.seen] == [0]
    assert [p.bytesDone for p, _ in fast.seen] == [0, *range(100, 1000, 100)]
    clock.t += 1.5  # 2.4 s after the last update it was sent
    r.advance(bytes=50)
    assert [p.bytesDone for p, _ in slow.seen] == [0, 950]
    r.advance(bytes=50, files=1)  # the totals are reached: sent at once
    assert slow.seen[-1][0].bytesDone == 1000 and slow.seen[-1][0].filesDone == 1
    r.phase("validate")  # a new phase: at once, with unknown totals
    got = slow.seen[-1][0]
    assert got.model_copy(update={"elapsed": 0}) == P(phase="validate") and got.elapsed == pytest.approx(2.4)
    clock.t += 5
    r.finish()
    assert slow.seen[-1][1] is True and slow.seen[-1][0].elapsed == pytest.approx(7.4)
    assert all(p.elapsed >= q.elapsed for (q, _), (p, _) in zip(slow.seen, slow.seen[1:], strict=False))


def test_absolute_progress_from_a_downloader_and_no_output_without_a_phase():
    sink = Collect(0.0)
    r = Reporter(sink, clock=Clock())
    r.finish()
    assert sink.seen == []  # nothing was reported: nothing to end
    r.phase("download")
    r.on_progress(300, 900, 1, 3)
    assert sink.seen[-1][0] == P(phase="download", bytesDone=300, bytesTotal=900, filesDone=1, filesTotal=3)


def test_log_lines_are_parseable_and_skip_repeats():
    out, clock = io.StringIO(), Clock()
    r = Reporter(LogLines(out, interval=0.0), clock=clock)
    r.phase("convert", total_bytes=10)
    r.advance()  # nothing changed: no line
    clock.t += 1
    r.advance(bytes=10)
    r.finish()
    lines = out.getvalue().splitlines()
    assert [parse_progress(x).bytesDone for x in lines] == [0, 10, 10]
    assert parse_progress(out.getvalue()) == P(phase="convert", bytesDone=10, bytesTotal=10, elapsed=1)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_plain_lines_off_a_terminal_and_a_bar_on_one():
    plain = io.StringIO()
    r = Reporter(Console(plain, label="import"), clock=Clock())
    r.phase("convert", total_bytes=200)
    r.advance(bytes=50)  # within the plain interval: not shown
    r.advance(bytes=150)  # the total: shown
    assert plain.getvalue().splitlines() == [
        "[import] convert 0% 0/200B 0s",
        "[import] convert 100% 200/200B 0s",
    ]
    assert "\r" not in plain.getvalue()
    tty, clock = Tty(), Clock()
    r = Reporter(Console(tty), clock=clock)
    r.phase("convert", total_bytes=100)
    r.advance(bytes=10)  # within 0.2 s: not drawn
    clock.t += 0.25
    r.advance(bytes=40)
    r.phase("validate")
    r.finish()
    shown = tty.getvalue()
    assert "\r\x1b[2K" + bar(P(phase="convert", bytesDone=0, bytesTotal=100)) in shown
    assert "[" + "#" * 12 + "-" * 12 + "] 50% 50/100B 0s" in shown and "10/100B" not in shown
    assert shown.endswith("validate 0s\n") and shown.count("\n") == 2  # a line per phase


def test_operator_status_from_a_log_tail():
    tail = "starting\n" + line(phase="download", bytesDone=35, bytesTotal=100, elapsed=20) + "\n"
    got = compile_progress(tail, "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z")
    assert got == {
        "phase": "download",
        "bytesDone": 35,
        "bytesTotal": 100,
        "filesDone": None,
        "filesTotal": None,
        "startedAt": "2026-01-01T00:00:00Z",
        "elapsed": 60.0,
        "text": "download 35% 35/100B 1m00s",
        "updatedAt": "2026-01-01T00:01:00Z",
    }  # fmt: skip (the elapsed time is counted to now: a long step prints no line)
    assert compile_progress("no progress\n", None, "2026-01-01T00:01:00Z") is None
    assert (
        compile_progress(line(phase="compile", elapsed=5), None, "2026-01-01T00:01:00Z")["text"]
        == "compile 5s"
    )


def at(s: int) -> str:
    return f"2026-01-01T00:{s // 60:02d}:{s % 60:02d}Z"


def shown(phase: str, text: str, s: int) -> dict:
    return {"phase": phase, "text": text, "updatedAt": at(s)}


@pytest.mark.parametrize(
    "old, new, now, kept",
    [
        (None, shown("convert", "convert 1%", 10), 10, "new"),  # the first
        (shown("convert", "convert 1%", 0), shown("convert", "convert 9%", 14), 14, "old"),  # too soon
        (shown("convert", "convert 1%", 0), shown("convert", "convert 9%", 15), 15, "new"),
        (shown("convert", "convert 1%", 0), shown("validate", "validate 3s", 5), 5, "new"),  # a new phase
        (shown("convert", "convert 1%", 0), shown("convert", "convert 1%", 60), 60, "old"),  # unchanged
        (shown("convert", "convert 1%", 0), None, 60, "old"),  # nothing read
    ],
)
def test_status_is_written_when_what_it_shows_changed_at_most_every_15_s(old, new, now, kept):
    assert progress_due(old, new, at(now)) is (new if kept == "new" else old)


def test_the_compiled_condition_and_the_column_carry_the_progress_and_ready_clears_it():
    progress = compile_progress(line(phase="convert", bytesDone=1, bytesTotal=4), None, at(30))
    common = dict(generation=1, errors=[], compile_hash="h1", endpoint=None, at=at(30))
    compiling = compute_status(old={}, serving_hash=None, job=("running", "compile Job j is running"),
                               roles={}, compiling=progress, **common)  # fmt: skip
    assert compiling["compileProgress"]["text"] == "convert 25% 1/4B 0s"
    cond = next(c for c in compiling["conditions"] if c["type"] == "Compiled")
    assert cond["message"] == "compiling h1: compile Job j is running; convert 25% 1/4B 0s"
    ready = compute_status(old=compiling, serving_hash="h1", job=("succeeded", ""), roles={"unified": (1, 1)},
                           compiling=progress, **common)  # fmt: skip
    assert ready["phase"] == "Ready" and ready["compileProgress"] is None


def test_an_engine_compile_script_prints_a_progress_line_with_its_elapsed_time():
    script = "T0=$(( $(date +%s) - 7 ))\necho before\n" + progress_echo("compile") + "echo after\n"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    got = parse_progress(out)
    assert got is not None and got.phase == "compile" and 7 <= got.elapsed <= 9


def test_a_folder_being_downloaded_into_is_measured_as_it_fills(tmp_path):
    """`watch_folder`, as around the Hub's snapshot download: partial blobs (`.incomplete`) count in bytes,
    not in files; links (the snapshot's names for the blobs) count in neither; the counts only grow while
    the download runs, and the last report is the whole download."""
    import threading

    from support import wait_until

    from neuronfleet.runtime.progress import folder_size, watch_folder

    blobs = tmp_path / "models--org--name" / "blobs"  # not there until the download starts
    seen: list[tuple] = []
    moved = threading.Event()

    def download() -> None:
        blobs.mkdir(parents=True)
        written = 0
        for i in range(3):
            part = blobs / f"blob{i}.incomplete"
            with part.open("wb") as f:
                for _ in range(4):
                    f.write(b"x" * 1000)
                    f.flush()
                    written += 1000
                    # the next write waits for a report of this one: reports come while it downloads
                    wait_until(lambda w=written: seen and seen[-1][0] >= w, f"a report of {written} bytes")
            part.rename(blobs / f"blob{i}")
        (tmp_path / "models--org--name" / "model.safetensors").symlink_to(blobs / "blob0")
        moved.set()

    with watch_folder(blobs, lambda *report: seen.append(report), 12000, 3, interval=0.01):
        download()
    assert moved.is_set()
    assert seen[-1] == (12000, 12000, 3, 3)
    assert [r[0] for r in seen] == sorted(r[0] for r in seen)  # bytes only grow
    assert [r[2] for r in seen] == sorted(r[2] for r in seen)
    assert any(0 < r[0] < 12000 and r[2] < 3 for r in seen)  # reports came while it downloaded
    assert folder_size(tmp_path) == (12000, 3)  # the link is not a second copy


def test_a_file_a_read_of_the_folder_misses_does_not_send_the_progress_back(tmp_path):
    """A read of the folder can miss a file that is being renamed (its partial name gone, its final one not
    yet listed; the suite saw a report of 0 bytes after one of 1000 so): a file that leaves the folder stands
    in for it here, and the reports after it stay at what had arrived."""
    from support import wait_until

    from neuronfleet.runtime.progress import watch_folder

    seen: list[tuple] = []
    blob = tmp_path / "blob.incomplete"
    with watch_folder(tmp_path, lambda *report: seen.append(report), 2000, 1, interval=0.01):
        blob.write_bytes(b"x" * 1000)
        wait_until(lambda: seen and seen[-1][0] == 1000, "a report of 1000 bytes")
        blob.unlink()
        after = len(seen)
        wait_until(lambda: len(seen) > after + 2, "reports after the file left")
    assert [r[0] for r in seen[after:]] == [1000] * len(seen[after:])
