#!/usr/bin/env bash
# After a lease: merge the libraries' autotune choices it brought back (fla_autotune.tar.xz from a `final` call) into
# the committed scripts/device_lease/fla_autotune.tar.xz, which chain.sh restores on the next fresh machine.
#   bash scripts/device_lease/merge_autotune.sh /work/leaseout/call3/fla_autotune.tar.xz
# Entries are Triton's autotune cache files: keyed by Triton's version, the GPU target, the kernel's source, the
# autotune key and the config list, so a stale one is never read. Our kernels (names starting with '_') stay out.
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -f fla_autotune.tar.xz ] && xz -dc fla_autotune.tar.xz | tar xf - -C "$tmp"
for f in "$@"; do xz -dc "$f" | tar xf - -C "$tmp"; done
(cd "$tmp" && find . -name '*.autotune.json' ! -name '_*' | sort | tar cf - -T -) | xz -9 > fla_autotune.tar.xz
echo "fla_autotune.tar.xz: $(xz -dc fla_autotune.tar.xz | tar tf - | wc -l) entries, $(stat -c %s fla_autotune.tar.xz) bytes"
