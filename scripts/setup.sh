#!/usr/bin/env bash
# scripts/setup.sh — install what moelab needs from Debian's packages, and nothing else.
#
# Idempotent: each package is checked with dpkg first, so a machine that already has
# everything does no network work at all. Needs root (or sudo) only when something is
# missing. CUDA, cuBLAS and NCCL are expected in the toolkit's default location and are
# optional: without nvcc the cuda backend is simply not built.
set -euo pipefail

packages=(
  cmake g++ make
  libopenmpi-dev openmpi-bin        # multi-rank cpu backend (mpirun), NCCL bootstrap
  nlohmann-json3-dev                # workload, cluster and result files
  libgtest-dev                      # tests
  libbenchmark-dev                  # micro-benchmarks
  libopenblas-dev                   # cpu GEMM
  python3-matplotlib                # plots (run with /usr/bin/python3)
  python3-hypothesis                # property-based tests of the suite files (scripts/tests)
  fortunes                          # English text for the quality comparison (scripts/quality.py)
)

missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "setup: need root to install ${missing[*]}" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
echo "setup: done"
