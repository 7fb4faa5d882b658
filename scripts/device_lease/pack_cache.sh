#!/usr/bin/env bash
# Packs a Triton cache for the next lease (step.sh's `final`): the whole cache if it compresses to at most LIMIT_MB,
# else the autotune results (*.autotune.json) and the whole entries of the kernels named in TCACHE_KEEP (default:
# falcon2's sequential kernels, 23-34 s each to compile for sm_90 and most of its GPU tests' time), else the autotune
# results alone. Entries are keyed by the kernel's source and Triton's own hash, so a stale one is just never hit.
#   bash scripts/device_lease/pack_cache.sh CACHE_DIR OUT.tar.xz [LIMIT_MB]
set -euo pipefail
C=$1; OUT=$2; LIMIT=$(( ${3:-60} * 1024 * 1024 ))
KEEP=${TCACHE_KEEP:-_fwd_h_delta_col _bwd_dhu_delta_col}
cd "$C"
tar cf - . | xz -T0 -1 > "$OUT"
[ "$(stat -c %s "$OUT")" -le $LIMIT ] && { echo "pack_cache: whole cache"; exit 0; }
list=$(mktemp)
find . -name '*.autotune.json' > "$list"
for k in $KEEP; do
    # an entry is a folder holding the kernel's files (NAME.cubin, NAME.json, __grp__NAME.json, ...)
    find . -name "$k.json" -printf '%h\n' | sort -u | while read -r d; do find "$d" -type f; done >> "$list"
done
sort -u "$list" | tar cf - -T - | xz -T0 -1 > "$OUT"
rm -f "$list"
if [ "$(stat -c %s "$OUT")" -le $LIMIT ]; then
    echo "pack_cache: autotune results and the entries of: $KEEP"
    exit 0
fi
find . -name '*.autotune.json' | tar cf - -T - | xz -T0 -1 > "$OUT"
echo "pack_cache: autotune results only"
