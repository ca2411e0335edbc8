#!/bin/bash
# Side-by-side offline throughput of two source trees (e.g. a `git archive` of an older commit
# and this checkout), interleaved, with the load average before each run:
#   bench/ab_offline.sh OLD_TREE NEW_TREE [ROUNDS] [EXTRA_ARGS]
#   bench/ab_offline.sh /tmp/pd-base . 2 "--compute-dtype bfloat16"
# Each run: cd TREE && python bench/offline_throughput.py --threads 1 --skip-hf [EXTRA_ARGS].
set -u
old=$1; new=$2; rounds=${3:-2}; extra=${4:-}
for i in $(seq 1 "$rounds"); do
  for tree in "$old" "$new"; do
    for args in "" ${extra:+"$extra"}; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      # shellcheck disable=SC2086
      line=$(cd "$tree" && python bench/offline_throughput.py --threads 1 --skip-hf $args 2>&1 | grep "^pdserve:")
      echo "$(date +%T) load=$load tree=$tree $args :: $line"
    done
  done
done
