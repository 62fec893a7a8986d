#!/usr/bin/env bash
# scripts/test.sh — install what is missing, build everything, run every test.
#
#   scripts/test.sh                 # build in ./build and run ctest
#   BUILD_DIR=/tmp/b scripts/test.sh
#   scripts/test.sh -R moe_layer    # extra arguments go to ctest
#
# The cuda backend is compiled whenever nvcc is present; its tests skip without a device.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
jobs="${JOBS:-$(nproc)}"

"$root/scripts/setup.sh"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOELAB_WERROR=ON
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs" "$@"
