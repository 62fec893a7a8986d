#!/usr/bin/env bash
# scripts/sanitize.sh — the whole test suite built with AddressSanitizer and
# UndefinedBehaviorSanitizer in a build folder of its own, then ctest. docs/FUZZING.md gives
# the last result.
#
#   scripts/sanitize.sh                     # build build-sanitize/ (gcc, or $CXX), run every test
#   scripts/sanitize.sh -R config           # extra arguments go to ctest
#   CXX=clang++ SANITIZE_BUILD_DIR=/tmp/bs JOBS=2 scripts/sanitize.sh
#
# The cuda backend is off (-DMOELAB_WITH_CUDA=OFF: the sanitizers instrument host code only;
# device code is checked with compute-sanitizer, scripts/gpu.sh run OUTDIR --only memcheck).
# UBSan stops at its first report, ASan at its first error; LeakSanitizer runs at every exit
# with scripts/lsan-openmpi.supp, which suppresses the allocations Open MPI makes once and never
# frees (MPI_Init's, not moelab's). A test that reports anything fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SANITIZE_BUILD_DIR:-$root/build-sanitize}"
jobs="${JOBS:-$(nproc)}"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

# Also during the build: gtest_discover_tests runs each test binary to list its tests.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$root/scripts/lsan-openmpi.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

mkdir -p "$build"
# Warnings are not errors here: the normal build judges them (the sanitizers change what the
# optimiser sees, and so what it warns of).
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOELAB_WERROR=OFF -DMOELAB_WITH_CUDA=OFF \
  -DMOELAB_WITH_BENCH=OFF -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
grep "moelab:" "$build/configure.log" || true
cmake --build "$build" -j "$jobs"
# Sanitized binaries are 2-5x slower: the per-test limits of CMake are scaled.
ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 900 "$@"
