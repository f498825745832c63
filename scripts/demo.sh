#!/usr/bin/env bash
# Starts the mesh (curfew up) on its embedded defaults, runs the demo plan with a 12 s
# deadline, disconnects at 3.5 s as a Ctrl-C would, and prints the run's summary: every
# node stopped with cause client_disconnect and no decoder spent tokens after the cancel.
# Then stops the mesh.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s build
data=$(mktemp -d)
trap 'kill -TERM $up 2>/dev/null || true; wait $up 2>/dev/null || true; rm -rf "$data"' EXIT
./bin/curfew up --data-dir "$data" --base-port "${CURFEW_BASE_PORT:-7700}" &
up=$!
for _ in $(seq 1 300); do
  [[ -f "$data/endpoints.json" ]] && break
  sleep 0.1
done
[[ -f "$data/endpoints.json" ]] || { echo "demo: the mesh did not start" >&2; exit 1; }
echo
echo "\$ curfew run --plan examples/plans/demo.json --deadline 12s --cancel-after 3.5s"
./bin/curfew run --data-dir "$data" --plan examples/plans/demo.json --deadline 12s --cancel-after 3.5s || true
