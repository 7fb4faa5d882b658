#!/usr/bin/env bash
# After a lease: keep the paper preset's finished runs from the lease's results.tgz files and rebuild the report.
#   bash scripts/device_lease/ingest.sh /work/.device/*/results.tgz
# A run is kept if its JSON says status "ok" (runs/<model>-s<seed>.json; the *.spec.json of runs still in flight
# are not packed) and no run of that name is kept yet (delete the old file to replace it). --report-only then
# reports only runs whose settings match the preset (others are listed as left out).
set -euo pipefail
cd "$(dirname "$0")/../.."
dst=results/addition/paper/runs
mkdir -p "$dst"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=0
for tgz in "$@"; do
    rm -rf "$tmp"/x && mkdir -p "$tmp"/x
    tar xzf "$tgz" -C "$tmp"/x 2>/dev/null || { echo "skip $tgz: not a results archive"; continue; }
    for f in "$tmp"/x/paper/runs/*.json; do
        [ -e "$f" ] || continue
        case "$f" in *.spec.json) continue ;; esac
        if [ -e "$dst/$(basename "$f")" ]; then
            echo "already kept: $(basename "$f") (not replaced by the one from $tgz)"
        elif python3 -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get('status') == 'ok' else 1)" "$f"; then
            cp "$f" "$dst/" && n=$((n + 1)) && echo "kept $(basename "$f") from $tgz"
        else
            echo "not kept (status not ok): $(basename "$f") from $tgz"
        fi
    done
done
echo "$n run(s) kept; rebuilding the report"
python3 -m evals.addition --preset paper --report-only
