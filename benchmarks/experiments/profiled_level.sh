#!/usr/bin/env bash
# One concurrency.py run in engine mode with py-spy sampling the engine's process and the users' (this
# benchmark's) process for SAMPLE_S seconds from SETTLE_S into the first level of LEVEL users (any level if
# unset) of the first workload: where their time goes.
# On the device machine, from the repository root, after the wheels are installed (py-spy among them):
#   OUTDIR=$OUT TAG=text bash benchmarks/experiments/profiled_level.sh --workload text --levels 200 --duration 20 --grace 12
# Writes $OUTDIR/$TAG.log, $TAG.json and the samples $TAG-engine.txt / $TAG-users.txt (py-spy's raw format:
# one line per stack, threads named, idle stacks included).
set -u
OUTDIR=${OUTDIR:-/tmp}
TAG=${TAG:-run}
SETTLE_S=${SETTLE_S:-6}
SAMPLE_S=${SAMPLE_S:-8}
log="$OUTDIR/$TAG.log"
python3 benchmarks/concurrency.py --json "$OUTDIR/$TAG.json" "$@" > "$log" 2>&1 &
bench=$!
until grep -q "level ${LEVEL:-.*} users: started" "$log" 2>/dev/null; do
    kill -0 "$bench" 2>/dev/null || { tail -20 "$log"; exit 1; }
    sleep 1
done
engine=$(sed -n 's/^engine process: //p' "$log" | head -1)
sleep "$SETTLE_S"
for who in engine users; do
    pid=$engine
    [ "$who" = users ] && pid=$bench
    py-spy record --pid "$pid" --duration "$SAMPLE_S" --rate 200 --nonblocking --threads --idle --format raw \
        --output "$OUTDIR/$TAG-$who.txt" > /dev/null 2>&1 &
done
wait "$bench"
wait
tail -4 "$log"
