"""What `neuronfleet up` in the foreground shows while models compile (`local.show_compiles`), against the
emulated API server: a line for every compileProgress the status had, however quickly the operator wrote
them one after another, one model's lines apart from another's, and the last one again when the compile ends
(its status loses compileProgress) or the model is deleted."""

from __future__ import annotations

import io
import threading

from support import OperatorCluster, wait_until

from neuronfleet.localcluster import local

MODELS = "/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels"
SPEC = {"model": {"uri": "pvc://local-models/smollm2-135m-instruct.gguf"}, "engine": "embedded",
        "neuron": {"instanceType": "cpu"}}  # fmt: skip


def write_progress(api: OperatorCluster, name: str, progress: dict | None) -> None:
    status = {"phase": "Compiling" if progress else "Ready", "compileProgress": progress}
    api.call("PATCH", f"{MODELS}/{name}/status", {"status": status}, "application/merge-patch+json")


def test_every_progress_the_status_had_is_shown_once_and_its_end(tmp_path):
    api = OperatorCluster(tmp_path)
    shown, stopped = io.StringIO(), threading.Event()
    follower = threading.Thread(target=local.show_compiles, args=(tmp_path, shown, stopped), daemon=True)
    try:
        for name in ("a", "b"):
            api.call("POST", MODELS, {"apiVersion": "neuronfleet.dev/v1alpha1", "kind": "NeuronModel",
                                      "metadata": {"name": name}, "spec": SPEC})  # fmt: skip
        write_progress(api, "a", {"phase": "download", "elapsed": 0.0, "updatedAt": "2026-12-01T00:00:00Z"})
        follower.start()
        lines = lambda: shown.getvalue().splitlines()  # noqa: E731
        wait_until(lambda: lines() == ["[default/a] download 0s"], "the progress it had before the watch")
        # ten writes with no pause between them: a reader that polled would miss most
        for second in range(1, 11):
            phase = "convert" if second > 5 else "download"
            update = {"phase": phase, "bytesDone": second, "bytesTotal": 10, "elapsed": float(second)}
            write_progress(api, "a", update)
        write_progress(api, "b", {"phase": "validate", "elapsed": 3.0})
        write_progress(api, "a", {"phase": "convert", "bytesDone": 10, "bytesTotal": 10, "elapsed": 10.0})
        write_progress(api, "a", None)  # Ready: compileProgress removed
        api.call("DELETE", f"{MODELS}/b")
        wait_until(lambda: len(lines()) >= 14, "every progress written, then both ends", ceiling=60)
        a = [x for x in lines() if x.startswith("[default/a] ")]
        assert [x.split(" ", 2)[1] for x in a] == ["download"] * 6 + ["convert"] * 6, a
        assert (
            a[5] == "[default/a] download 50% 5/10B 5s"
            and a[-2] == a[-1] == "[default/a] convert 100% 10/10B 10s"
        )
        assert [x for x in lines() if x.startswith("[default/b] ")] == ["[default/b] validate 3s"] * 2
        assert (
            len(lines()) == 14
        )  # the same progress twice (the write of elapsed 10 again) is not shown twice
    finally:
        stopped.set()
        api.api.stop()  # ends the watch
        follower.join(30)
    assert not follower.is_alive()
