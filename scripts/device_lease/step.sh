#!/usr/bin/env bash
# One call of the team's time-limited GPU machine (the `device` tool: one command of at most 10 minutes at
# a time; the machine stays warm ~30 s between calls). The first call installs the carried fla wheels
# (scripts/device_setup.sh), copies the repo to /tmp/br and starts chain.sh there in its own session, so
# the work outlives the call; every call then waits SECONDS, prints progress and packs what is done into
# $OUT/results.tgz. `final` also packs Triton's cache (tc.tar.xz.NN, 15 MiB parts) for a later machine.
#   run: bash scripts/device_lease/step.sh 540            (carry: .whl; settings for chain.sh in lease.env)
#        bash scripts/device_lease/step.sh 300 final
S=${1:-540}; FINAL=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
L=/tmp/L; mkdir -p $L
if [ ! -f $L/started ]; then
    touch $L/started
    . scripts/device_setup.sh || exit 1
    rm -rf /tmp/br && cp -r "$PWD" /tmp/br
    setsid bash /tmp/br/scripts/device_lease/chain.sh > $L/chain.log 2>&1 < /dev/null &
fi
# a later call may carry extra*.sh (work committed after the lease began): each runs once, from the tree of the
# first call that carries it
for x in scripts/device_lease/extra*.sh; do
    [ -f "$x" ] || continue
    n=$(basename "$x" .sh)
    [ -f $L/${n}_started ] && continue
    touch $L/${n}_started
    rm -rf /tmp/b_$n && cp -r "$PWD" /tmp/b_$n
    # (the wheels chain.sh uses, and this copy of the repo, on the path)
    (cd /tmp/b_$n && PYTHONPATH=/tmp/site:/tmp/b_$n PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 \
        setsid bash -c "bash $x; touch $L/${n}_done" > $L/$n.log 2>&1 < /dev/null &)
done
# everything the lease wrote (a fixed list of names once left out a probe's output: F3F, thirty-fifth lease), but
# $L/out (copied at the end as it is) and files over 7 MiB, which would crowd the 16 MiB a returned file may have.
# Packed every minute too: a call stopped at its limit returns what is under $OUT, and the fifty-second lease's
# only call (its limit the 483 s of device time left, less than SECONDS plus the machine's setup) returned nothing
pack() { (cd $L && find . -path ./out -prune -o -type f -size -8M ! -name '*.spec.json' -print \
    | tar czf $OUT/results.tgz.part --ignore-failed-read -T - 2>/dev/null) \
    && mv $OUT/results.tgz.part $OUT/results.tgz; }
# an extra script still running (started, not done) keeps the call waiting after the chain's end
extras_running() { for f in $L/extra*_started; do [ -f "$f" ] && [ ! -f "${f%_started}_done" ] && return 0; done; return 1; }
end=$((SECONDS + S))
while [ $SECONDS -lt $end ] && { ! grep -qE "^[0-9:]+ done$" <(tail -n 1 $L/stage 2>/dev/null) || extras_running; }; do
    # at most until SECONDS are up (a whole minute's sleep past them cost a lease's last call all its results)
    left=$((end - SECONDS)); sleep $((left < 60 ? left : 60))
    pack
    echo "--- $(date +%T) $(ls $L/paper/runs 2>/dev/null | grep -vc spec) runs done;" \
         "$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader); $(tail -n 1 $L/stage 2>/dev/null)"
done
echo "=== chain.log"; grep -v "^+ export\|^+ PYTHON\|^+ TRITON" $L/chain.log | tail -n 25
for f in $L/tests*.summary; do [ -f "$f" ] && { echo "=== $f"; tail -n 8 "$f"; }; done
echo "=== f3forms"; tail -n 30 $L/f3forms.log 2>/dev/null; cat $L/f3forms/*.md 2>/dev/null | head -n 60
echo "=== cfdiag"; cat $L/cfdiag/stages 2>/dev/null; cat $L/cfdiag/f3forms*/*.md 2>/dev/null | head -n 80
echo "=== profile"; grep -E "^==|ms " $L/profile.log 2>/dev/null | head -n 60
echo "=== paper"; grep -E "ok,|SKIPPED|failed|Error" $L/paper.log 2>/dev/null | cut -c1-200 | tail -n 30
for f in $L/probe/*/log; do [ -f "$f" ] && { echo "=== $f: $(cat ${f%log}args)"; grep -E "ok,|SKIPPED|step [0-9]+0000/" "$f" | cut -c1-160 | tail -n 8; }; done
echo "=== prebench"; grep -E "ms |^## |^\| (_|chunk|fal)" $L/prebench.log 2>/dev/null | head -n 80
echo "=== accuracy"; grep "^|" $L/accuracy.log $L/accuracy/*.md 2>/dev/null | tail -n 9
echo "=== bench"; tail -n 20 $L/bench.log 2>/dev/null
echo "=== precmd"; tail -n 25 $L/precmd.log 2>/dev/null
echo "=== sidecmd"; tail -n 15 $L/sidecmd.log 2>/dev/null
echo "=== sweep"; cat $L/sweep*/*.md 2>/dev/null
for f in $L/sp*/chunk.md; do [ -f "$f" ] && { echo "=== $f"; grep -E "^\| (chunk|fal)" "$f" | tail -n 8; }; done
echo "=== full"; grep -E "^## |^\| (fal|chunk)" $L/full/chunk.md 2>/dev/null | head -n 40
echo "=== alt"; grep -E "^## |^\| (_|chunk|fal)" $L/alt/chunk.md $L/alt/chunk_profile.md 2>/dev/null | head -n 60
for f in $L/extra*.log; do [ -f "$f" ] && { echo "=== $f"; tail -n 15 "$f"; }; done
# every kernel compiled on this machine so far (ours and the libraries', their configs as built for this GPU), searched
# for a shared-memory slot an asynchronous wgmma still reads when the pipeliner's next copy lands in it
echo "=== hazards"; python3 scripts/wgmma_hazards.py $HOME/.triton/cache > $L/hazards.txt 2>&1
grep -v "^    " $L/hazards.txt | tail -n 12
pack
cd $L
# files a command left in $L/out (at most 6, each under 16 MiB: the device's limits on what comes back) come back
# beside results.tgz, e.g. the parts of a launch recording (scripts/replay_launches.py, split -b 15M)
for f in $L/out/*; do [ -f "$f" ] && cp "$f" $OUT/; done
if [ "$FINAL" = final ]; then
    C=$HOME/.triton/cache
    # the libraries' autotune choices alone (kernel names not starting with '_'), to merge into the committed ones
    (cd $C && find . -name '*.autotune.json' ! -name '_*' | tar cf - -T -) | xz -9 > $OUT/fla_autotune.tar.xz
    # the whole cache if it fits 60 MB, else the autotune results and falcon2's slow-compiling kernels (TCACHE_KEEP)
    bash $HERE/pack_cache.sh $C /tmp/tc.tar.xz 60
    split -b 15M -d /tmp/tc.tar.xz $OUT/tc.tar.xz.
    ls -la $OUT
fi
