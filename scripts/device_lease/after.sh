#!/usr/bin/env bash
# After a lease, here: everything its last call brought back, in one go.
#   bash scripts/device_lease/after.sh /work/leaseout/call3          (the folder holding that call's files)
# - the paper preset's finished runs into results/addition/paper (ingest.sh) and its report rebuilt;
# - the libraries' autotune choices merged into fla_autotune.tar.xz (merge_autotune.sh), if the call was `final`;
# - launch recordings (keep_<name>.pt.aa, .ab, ... from scripts/replay_launches.py) joined and replayed under the
#   interpreter (replay_launches.py --mode replay), reports in /tmp/replay/<name>/.
# Then look at `git status`: commit what changed, with what the lease measured. Run it with the project's venv
# active (its python3 has torch).
set -euo pipefail
python3 -c 'import torch' 2>/dev/null || { echo "after.sh: python3 has no torch: activate the venv (. .venv/bin/activate)"; exit 1; }
src=${1:?usage: after.sh FOLDER_OF_THE_LAST_CALL}
cd "$(dirname "$0")/../.."
[ -f "$src/results.tgz" ] && bash scripts/device_lease/ingest.sh "$src/results.tgz"
[ -f "$src/fla_autotune.tar.xz" ] && bash scripts/device_lease/merge_autotune.sh "$src/fla_autotune.tar.xz"
for first in "$src"/keep_*.pt.aa; do
    [ -f "$first" ] || continue
    name=$(basename "$first" .pt.aa); name=${name#keep_}
    mkdir -p /tmp/replay/$name
    cat "${first%.aa}".* > /tmp/replay/$name/launches_keep.pt
    echo "=== replay of $name (the first run's kept launches, under the interpreter)"
    python3 scripts/replay_launches.py --mode replay --file launches_keep.pt --out /tmp/replay/$name
done
