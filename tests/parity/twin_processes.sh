#!/usr/bin/env bash
# `twin fixture` with its ranks as processes (mpirun -np N) against the same run with its ranks as
# threads of one process. Run by CTest (tests/parity/CMakeLists.txt) as
#   twin_processes.sh reports TWIN MPIEXEC SOURCE_DIR      every dense and MoE golden of
#       fixtures/megatron-core/ at --tp N, --tp N --sp and --ep N (N = 2, 4): the --json reports
#       (every tensor's error and bound, gradients, routing) are identical line for line
#   twin_processes.sh failing-rank TWIN MPIEXEC SOURCE_DIR  rank 1 throws (TWIN_FAIL_RANK=1) while
#       rank 0 waits in a collective: the launch exits non-zero within the collective timeout (5 s
#       here) plus start-up, and rank 0's report names rank 1
set -euo pipefail
mode=$1 twin=$2 mpiexec=$3 src=$4
# Open MPI refuses root without these; one core per rank is more than CI has.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
mpirun() { "$mpiexec" -np "$1" --oversubscribe "${@:2}"; }
goldens=("$src"/fixtures/megatron-core/dense_*.safetensors "$src"/fixtures/megatron-core/moe_*.safetensors)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

case "$mode" in
  reports)
    for n in 2 4; do
      for flags in "--tp $n" "--tp $n --sp" "--ep $n"; do
        # shellcheck disable=SC2086  # $flags is two or three words
        "$twin" fixture --twin optimized --json $flags "${goldens[@]}" >"$out/threads.jsonl" || true
        # shellcheck disable=SC2086
        mpirun "$n" "$twin" fixture --twin optimized --json $flags "${goldens[@]}" >"$out/processes.jsonl" || true
        if ! cmp -s "$out/threads.jsonl" "$out/processes.jsonl"; then
          echo "FAIL: $flags: the report over $n processes differs from the threaded one:" >&2
          diff "$out/threads.jsonl" "$out/processes.jsonl" | head -20 >&2
          exit 1
        fi
        passed=$(grep -c '"status":"pass"' "$out/threads.jsonl" || true)
        echo "$flags: $(wc -l <"$out/threads.jsonl") reports identical over threads and $n processes ($passed pass)"
        [ "$passed" -gt 0 ] || { echo "FAIL: $flags: no golden passed; nothing was compared" >&2; exit 1; }
      done
    done
    ;;
  failing-rank)
    golden="$src/fixtures/megatron-core/dense_ln_mha_gelu_bias.safetensors"
    start=$SECONDS
    set +e
    TWIN_FAIL_RANK=1 TWIN_COLLECTIVE_TIMEOUT_S=5 mpirun 2 "$twin" fixture --twin optimized --tp 2 "$golden" \
      >"$out/stdout" 2>"$out/stderr"
    code=$?
    set -e
    took=$((SECONDS - start))
    cat "$out/stdout" "$out/stderr"
    [ "$code" -ne 0 ] || { echo "FAIL: exit status 0 with rank 1 failing" >&2; exit 1; }
    grep -q "rank 1 failed" "$out/stdout" "$out/stderr" || { echo "FAIL: the failing rank is not named" >&2; exit 1; }
    [ "$took" -le 60 ] || { echo "FAIL: took $took s, past the 5 s collective timeout and start-up" >&2; exit 1; }
    echo "exit status $code after $took s, rank 1 named"
    ;;
  *)
    echo "usage: $0 reports|failing-rank TWIN MPIEXEC SOURCE_DIR" >&2
    exit 2
    ;;
esac
