#!/usr/bin/env bash
# The demo: install, prepare the stdlib corpus, start a local Ray head, submit the pretraining job
# with one injected worker kill, stream its logs, stop the head, and say how to open MLflow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .venv/bin/activate
export RAY_AUTH_MODE=token  # Ray's token (~/.ray/auth_token) for the clients below; docs/cluster.md#security
python jobs/prepare_data.py --output data/stdlib
bash scripts/start_head.sh >/dev/null  # token authentication, listening on 127.0.0.1 only
trap 'ray stop >/dev/null 2>&1 || true' EXIT
AUTH="Authorization: Bearer $(ray get-auth-token)"
for _ in $(seq 1 60); do curl -sf -H "$AUTH" http://127.0.0.1:8265/api/version >/dev/null && break; sleep 1; done
RUN_NAME="demo-$(date +%Y%m%d-%H%M%S)"  # a new run each time, so the injected failure happens again
SUBMIT_LOG="$(mktemp)"
AGENT_DEADLINE=$((SECONDS + 90))
while true; do  # the dashboard answers before its job agent is up: Ray says "try again later"
  set +e
  ray job submit --address http://127.0.0.1:8265 -- python "$PWD/jobs/pretrain.py" --config "$PWD/configs/demo.yaml" \
    "run.name=$RUN_NAME" "data.path=$PWD/data/stdlib" "run.storage_path=$PWD/runs" "tracking.uri=sqlite:///$PWD/mlflow.db" \
    "$@" 2>&1 | tee "$SUBMIT_LOG"
  status=${PIPESTATUS[0]}
  set -e
  grep -q "No available agent to submit job" "$SUBMIT_LOG" && [ "$SECONDS" -lt "$AGENT_DEADLINE" ] || break
  echo "(Ray's job agent is still starting: submitting again in 2 s)"
  sleep 2
done
if [ "$status" -ne 0 ]; then
  grep -q "No available agent to submit job" "$SUBMIT_LOG" && echo "error: Ray's job agent did not start in 90 s;" \
    "is another Ray instance running on this machine (its agent holds port 52365)? stop it and run the demo again" >&2
  exit "$status"
fi
echo
# The run's page in MLflow's model-training view (MLflow 3's UI opens its GenAI view unless asked)
RUN_ID="$(sed -n 's/.*MLflow run id \([0-9a-f]\{32\}\).*/\1/p' "$SUBMIT_LOG" | tail -n 1)"
EXPERIMENT_ID="$(.venv/bin/python -c 'import sys; from mlflow import MlflowClient
print(MlflowClient(sys.argv[1]).get_run(sys.argv[2]).info.experiment_id)' "sqlite:///$PWD/mlflow.db" "$RUN_ID" 2>/dev/null || true)"
UI_LINK="http://127.0.0.1:5000/#/experiments"
if [ -n "$EXPERIMENT_ID" ]; then UI_LINK="$UI_LINK/$EXPERIMENT_ID/runs/$RUN_ID"; fi
echo "MLflow UI: .venv/bin/mlflow ui --backend-store-uri sqlite:///$PWD/mlflow.db --host 127.0.0.1 --port 5000"
echo "           then open $UI_LINK?workflowType=machine_learning (run $RUN_NAME)"
echo "Recovery history: .venv/bin/raytrain-ft history $RUN_NAME --tracking-uri sqlite:///$PWD/mlflow.db"
