#!/usr/bin/env bash
# scripts/reproduce.sh — install what is missing, build, and run the main job: every workload
# in experiments/workloads through every implementation on what this machine has, writing
# result JSON files (each says measured or simulated, on what, at which commit) and a summary.
#
#   scripts/reproduce.sh                 # everything this machine can run
#   scripts/reproduce.sh --quick         # the small workloads only
#   scripts/reproduce.sh --out DIR       # results under DIR instead of results/
#
# What runs where:
#   cpu backend   always; 1 rank and 4 MPI ranks (mpirun --oversubscribe)
#   cuda backend  when a CUDA device is present (single GPU)
#   sim backend   always: the paper clusters (experiments/hardware/clusters), datasheet
#                 calibration unless a profile is committed for the cluster's GPU
#   a real cluster: launch the same binary under your mpirun/srun with a host list, e.g.
#     mpirun -np 16 --hostfile hosts build/harness/moelab run --backend cuda --workload W --impl fastmoe
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
out="$root/results"
quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "reproduce.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

"$root/scripts/setup.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target moelab moelab_bench_cpu moelab_bench_sim
moelab="$build/harness/moelab"

cpu_workloads=(tiny small)
[ "$quick" = 1 ] && cpu_workloads=(tiny)
runs=()
for w in "${cpu_workloads[@]}"; do
  for np in 1 4; do runs+=("cpu $np $w"); done
done
if "$moelab" list 2>/dev/null | grep -q "cuda   available"; then
  runs+=("cuda 1 small" "cuda 1 gpt3-xl-e64-16k")
fi
sim_runs=("dgx-a100x2 small" "pcie-a30x1 tiny" "dgx-a100x8 gpt3-xl-e64-16k")
[ "$quick" = 1 ] && sim_runs=("dgx-a100x1 small")
for r in "${sim_runs[@]}"; do runs+=("sim:${r% *} 0 ${r#* }"); done

total=${#runs[@]}
i=0
start=$(date +%s)
summary=()
for r in "${runs[@]}"; do
  read -r backend np w <<<"$r"
  i=$((i + 1))
  if [ "${backend%%:*}" = sim ]; then
    dest="$out/simulated/${backend#sim:}/$w-fastmoe.json"
    echo "[$i/$total] $w simulated on ${backend#sim:} -> ${dest#$root/}"
  else
    dest="$out/measured/$backend/$w-fastmoe-np$np.json"
    echo "[$i/$total] $w on $backend, $np rank(s) -> ${dest#$root/}"
  fi
  if [ "${backend%%:*}" = sim ]; then
    # Simulated steps differ only by their routing draw: two are enough (and keep traces small).
    cluster="${backend#sim:}"
    "$moelab" run --workload "$root/experiments/workloads/$w.json" --impl fastmoe --backend sim --cluster "$cluster" \
      --steps 2 --out "$dest" --trace "$out/simulated/$cluster/$w-fastmoe.trace.json"
  elif [ "$np" = 1 ]; then
    "$moelab" run --workload "$root/experiments/workloads/$w.json" --impl fastmoe --backend "$backend" --out "$dest"
  else
    mpirun --oversubscribe -np "$np" "$moelab" run --workload "$root/experiments/workloads/$w.json" \
      --impl fastmoe --backend "$backend" --out "$dest"
  fi
  summary+=("$(printf '%-22s %-5s %3s  %s' "$w" "$backend" "$np" "${dest#$root/}")")
  now=$(date +%s)
  echo "    elapsed $((now - start)) s, about $(( (now - start) * (total - i) / i )) s left"
done

# Every schedule and restore strategy for real: 4 MPI ranks on the cpu backend, tiny
# workload, each with its measured timeline (Chrome trace).
sched_dir="$out/measured/cpu/schedules"
mkdir -p "$sched_dir"
schedules=("fastmoe fastmoe {}" "fastermoe-g2 fastermoe {\"group_size\":2}" "mpipemoe-n2 mpipemoe {\"partitions\":2}"
           "mpipemoe-auto mpipemoe {\"partitions\":\"auto\",\"min_partition_tokens\":64}")
for st in S1 S2 S3 S4; do schedules+=("mpipemoe-n2-$st mpipemoe {\"partitions\":2,\"strategy\":\"$st\"}"); done
j=0
for sc in "${schedules[@]}"; do
  read -r label impl opts <<<"$sc"
  j=$((j + 1))
  echo "[schedule $j/${#schedules[@]}] $label ($impl $opts) on cpu, 4 ranks -> ${sched_dir#$root/}/$label.json"
  mpirun --oversubscribe -np 4 "$moelab" run --workload "$root/experiments/workloads/tiny.json" --impl "$impl" \
    --impl-options "$opts" --backend cpu --out "$sched_dir/$label.json" --trace "$sched_dir/$label.trace.json" >/dev/null
done

mkdir -p "$out/bench"
"$build/harness/moelab_bench_cpu" --benchmark_min_time=0.05 --benchmark_context=mode=measured \
  --benchmark_out="$out/bench/cpu_blocks.json" --benchmark_out_format=json >/dev/null

echo
echo "measured results (fastmoe baseline):"
printf '%-22s %-5s %3s  %s\n' workload back ranks file
for s in "${summary[@]}"; do echo "$s"; done
echo "cpu micro-benchmarks: ${out#$root/}/bench/cpu_blocks.json"
echo "simulator speed: ${out#$root/}/bench/sim.json"
"$build/harness/moelab_bench_sim" --benchmark_context=mode=measured --benchmark_context=what=host_seconds_of_the_simulator --benchmark_out="$out/bench/sim.json" --benchmark_out_format=json >/dev/null
