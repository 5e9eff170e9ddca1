"""Resume latency: what a client streaming through the front door sees when the pod carrying its stream dies.

Two `neuronfleet serve` pods of SmolLM2 (bench/routing.py's model folder, --slots 2, float32) behind a front
door (which resumes streams: runtime/routing/resume.py).
Each round streams one greedy chat (the official `openai` client, max_retries=0), kills the pod carrying it
(SIGKILL) after --after tokens, and measures at the client the gap from the kill to the next token (the
resume: the front door's read breaks, it sends the prompt and the tokens sent to the other pod, which
prefills them and decodes the next one), against the stream's median gap between tokens; it checks the
answer equals an undisturbed pod's, token for token. The killed pod is replaced by a new one (the front
door's static peer map rewritten) before the next round. Prints p50 and max and writes
bench/results/resume_latency.json with the CPU it ran on.

    .venv/bin/python -P bench/resume_latency.py [--rounds 10] [--after 8] [--max-tokens 48]

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/: not on sys.path under -P)
from machine import cpu_name  # bench/machine.py
from routing import Processes, model_dir  # bench/routing.py

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Write a short story about a lighthouse keeper and the storm that changed his life."


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def running(url: str) -> float:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--after", type=int, default=8, help="tokens streamed before the kill")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    model = model_dir()
    serve = [
        "--model",
        str(model),
        "--served-model-name",
        "smollm2",
        "--slots",
        "2",
        "--max-seq-len",
        "512",
        "--dtype",
        "float32",
    ]  # (bfloat16 rounds differently for other row counts: no exact greedy)
    logs = Path(tempfile.mkdtemp(prefix="resume-latency-"))
    procs = Processes(logs)
    peers = logs / "peers.json"
    ask = dict(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
               max_tokens=args.max_tokens, temperature=0)  # fmt: skip
    gaps, itls, equal = [], [], 0
    try:
        pods = {}
        for i in range(2):
            url = procs.start(f"pod{i}", *serve)
            pods[url] = procs.procs[-1]
        peers.write_text(json.dumps({"unified:8000": [u.removeprefix("http://") for u in pods]}))
        door = procs.start("door", "--role", "router", "--served-model-name", "smollm2", "--unified",
                           "dns://unified:8000", "--peer-hosts-file", str(peers), "--model", str(model),
                           "--peer-probe-interval", "0.5", "--routing", "least-loaded")  # fmt: skip
        want = client(next(iter(pods))).chat.completions.create(**ask).choices[0].message.content
        for n in range(args.rounds):
            stream = client(door).chat.completions.create(**ask, stream=True)
            pieces, stamps, killed_at = [], [], None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    stamps.append(time.monotonic())
                if len(pieces) == args.after and killed_at is None:
                    victim = next(u for u in pods if running(u) > 0)
                    pods[victim].send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
            after = [t for t in stamps if t > (killed_at or 0)]
            gaps.append(after[0] - killed_at)
            itls.append(statistics.median(b - a for a, b in itertools.pairwise(stamps)))
            equal += "".join(pieces) == want
            print(f"round {n}: resumed in {gaps[-1] * 1000:.0f} ms (tokens every {itls[-1] * 1000:.0f} ms); "
                  f"{'equal' if ''.join(pieces) == want else 'DIFFERENT'}")  # fmt: skip
            pods[victim].wait()
            del pods[victim]
            url = procs.start(f"pod-{n}", *serve)
            pods[url] = procs.procs[-1]
            peers.write_text(json.dumps({"unified:8000": [u.removeprefix("http://") for u in pods]}))
            time.sleep(1.5)  # the front door's probes (every 0.5 s) find the new pod ready
    finally:
        procs.stop()
    ms = lambda xs: round(1000 * xs, 1)  # noqa: E731
    report = {
        "cpu": cpu_name(), "rounds": args.rounds, "after_tokens": args.after, "max_tokens": args.max_tokens,
        "resume_ms": {"p50": ms(statistics.median(gaps)), "max": ms(max(gaps))},
        "token_gap_ms": {"p50": ms(statistics.median(itls))}, "equal_to_undisturbed": equal,
        "command": "bench/resume_latency.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    out = ROOT / "bench" / "results" / "resume_latency.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
