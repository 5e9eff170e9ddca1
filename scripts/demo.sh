#!/usr/bin/env bash
# The main job on the embedded default, the whole journey on this machine (no cluster, no Neuron hardware):
# set up, `neuronfleet up` (emulated API server + process kubelet + the operator), `kubectl apply` the local
# SmolLM2 sample, wait until it is Ready (its compile Job really compiles, its pod really serves), send a chat
# request to its endpoint with curl (the OpenAI API; no sampling fields, as a user sends it: the model's
# defaults apply), then `neuronfleet down`. Prints each phase's time and the answer's text (`--raw`: the
# whole JSON answer as the API sent it). SETUP=0 skips the set-up (.venv exists).
#   bash scripts/demo.sh [--raw] ["a question"]
set -euo pipefail
cd "$(dirname "$0")/.."
RAW=
if [ "${1:-}" = --raw ]; then RAW=1; shift; fi
QUESTION=${1:-What is the capital of France?}
SAMPLE=${SAMPLE:-crds/samples/smollm2-135m-local-cpu.yaml}
STATE=${STATE:-.neuronfleet}
KUBECTL=${KUBECTL:-$(command -v kubectl || true)}
[ -n "$KUBECTL" ] || { echo "demo: kubectl is needed (a real client talks to the emulated API server)" >&2; exit 1; }
clock() { date +%s.%N; }
took() { .venv/bin/python -P -c 'import sys, time; print(f"[demo] {sys.argv[1]}: {time.time() - float(sys.argv[2]):.1f} s")' "$1" "$2"; }

if [ "${SETUP:-1}" != 0 ]; then t=$(clock); bash scripts/setup.sh; took "set-up" "$t"; fi
t=$(clock)
.venv/bin/neuronfleet down --state "$STATE" >/dev/null  # a fleet left from an interrupted run
.venv/bin/neuronfleet up --state "$STATE" --detach
trap '.venv/bin/neuronfleet down --state "$STATE"' EXIT
took "neuronfleet up" "$t"
K="$KUBECTL --kubeconfig $STATE/kubeconfig --cache-dir $STATE/kubectl-cache"
NAME=$(.venv/bin/python -P -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' "$SAMPLE")

t=$(clock)
$K apply -f "$SAMPLE"
for _ in $(seq 1 600); do
  PHASE=$($K get neuronmodel "$NAME" -o jsonpath='{.status.phase}')
  [ "$PHASE" = Ready ] && break
  [ "$PHASE" = Failed ] && { $K describe neuronmodel "$NAME" >&2; exit 1; }
  sleep 1
done
[ "$PHASE" = Ready ] || { echo "demo: $NAME did not become Ready" >&2; .venv/bin/neuronfleet status --state "$STATE"; exit 1; }
took "apply -> Ready (compile Job, then the serving pod)" "$t"
$K get neuronmodels,pods

ENDPOINT=$($K get neuronmodel "$NAME" -o jsonpath='{.status.endpoint}')
BODY=$(.venv/bin/python -P -c 'import json, sys; print(json.dumps({"model": sys.argv[2], "max_tokens": 96,
  "messages": [{"role": "user", "content": sys.argv[1]}]}))' "$QUESTION" "$NAME")
t=$(clock)
echo "[demo] POST $ENDPOINT/v1/chat/completions"
ANSWER=$(curl -sS "$ENDPOINT/v1/chat/completions" -H 'Content-Type: application/json' -d "$BODY")
took "the chat request" "$t"
if [ -n "$RAW" ]; then
  echo "$ANSWER"
else  # the answer's text, then its token counts; an error as the server said it
  .venv/bin/python -P - "$ANSWER" <<'PY'
import json, sys
answer = json.loads(sys.argv[1])
if "choices" not in answer:
    sys.exit(f"[demo] the model answered with an error: {json.dumps(answer)}")
print("\n" + answer["choices"][0]["message"]["content"] + "\n")
usage = answer.get("usage") or {}
print(f"[demo] {usage.get('prompt_tokens')} prompt tokens, {usage.get('completion_tokens')} generated")
PY
fi
