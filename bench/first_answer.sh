#!/usr/bin/env bash
# Time to first answer as a new user meets it: a fresh clone, the README's install, `pdserve up`
# on an empty PDSERVE_HOME (the default model fetched, checked and converted; the CPU kernels
# built), then the README's chat command. Prints each phase's seconds and the answer.
#   bash bench/first_answer.sh [REPO] [PORT]      (REPO: default this checkout)
set -euo pipefail
repo="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
port="${2:-50071}"
work="$(mktemp -d)"
trap 'kill -TERM "${up:-0}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
git clone -q "$repo" "$work/pdserve" && cd "$work/pdserve"
export PDSERVE_HOME="$work/home"
t0=$(date +%s.%N)
python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 -e ".[test,ray,bench]" > "$work/pip.log" 2>&1
t1=$(date +%s.%N)
pdserve up --port "$port" > "$work/up.log" 2>&1 &
up=$!
deadline=$((SECONDS + 600))
until grep -q "pdserve is up" "$work/up.log"; do
  kill -0 "$up" 2>/dev/null || { cat "$work/up.log"; exit 1; }
  (( SECONDS < deadline )) || { echo "not up after 600 s"; exit 1; }
  sleep 0.2
done
t2=$(date +%s.%N)
answer=$(printf 'What is the capital of France?\n' | timeout 300 pdserve chat --router "127.0.0.1:$port" --temperature 0)
t3=$(date +%s.%N)
python3 -c "import sys; a,b,c,d=map(float,sys.argv[1:]); print(f'install {b-a:.0f} s; pdserve up {c-b:.0f} s; first answer {d-c:.1f} s; total {d-a:.0f} s')" "$t0" "$t1" "$t2" "$t3"
echo "answer: $answer"
echo "commit: $(git rev-parse --short HEAD); cpu: $(lscpu | sed -n 's/^Model name: *//p'); load: $(cut -d' ' -f1-3 /proc/loadavg)"
