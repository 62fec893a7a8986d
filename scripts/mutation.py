#!/usr/bin/env python3
"""scripts/mutation.py — a mutation pass: does a unit test notice when a model's line is wrong?

Each mutant in scripts/mutants.json replaces one exact piece of a source file (a term dropped,
a comparison turned, a factor changed) and names the test binaries that should notice. For each,
the script writes the change into this checkout, rebuilds those test targets in the build
folder, runs them, and puts the file back; a mutant is killed when a test fails. Survivors the
list explains ("survives": why) are reported but pass; any other survivor fails the run.

    /usr/bin/python3 scripts/mutation.py                       # every mutant, in build-mutation/ (minutes: docs/FUZZING.md)
    /usr/bin/python3 scripts/mutation.py --build /tmp/b m1 n4  # only these ids, in another build folder

The build folder must not use -Werror (a mutant's harmless warning, an unused variable, would
stop its build): build-mutation/ is configured so when it does not exist (Release,
-DMOELAB_WERROR=OFF); a folder configured with MOELAB_WERROR=ON is refused. The files
are put back even when the run is interrupted (Ctrl-C), and the touched targets are rebuilt
from them at the end. Exit code: 0 all killed or explained, 1 an unexplained survivor or an
invalid mutant (it does not build, or a test binary it names is missing), 2 bad input.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fail(msg):
    print(f"mutation.py: {msg}", file=sys.stderr)
    sys.exit(2)


def find_binary(build, name):
    for d, _, files in os.walk(build):
        if name in files and os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return None


def build(build_dir, targets):
    return subprocess.run(["cmake", "--build", build_dir, "-j", str(os.cpu_count() or 2), "--target", *targets],
                          capture_output=True, text=True)


def run_mutant(m, build_dir):
    """'killed by T', 'survived' or 'invalid: why'. The file is restored by the caller."""
    b = build(build_dir, m["tests"])
    if b.returncode != 0:
        return "invalid: the mutant does not build"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for t in m["tests"]:
        exe = find_binary(build_dir, t)
        if exe is None:
            return f"invalid: no test binary {t} in {build_dir}"
        # An MPI test (add_moelab_mpi_test) runs as ctest runs it: on 1, 2 and 4 ranks.
        launches = [[exe]]
        if t.endswith("_mpi_test"):
            launches += [["mpirun", "--oversubscribe", "-np", str(n), exe] for n in (2, 4)]
        for cmd in launches:
            r = subprocess.run(["timeout", "900", *cmd, "--gtest_brief=1"], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                failed = [line.split("]", 1)[1].split("(")[0].strip() for line in r.stdout.splitlines()
                          if line.startswith("[  FAILED  ]") and "(" in line]
                where = f"{t}, {cmd[3]} ranks" if cmd[0] == "mpirun" else t
                return f"killed by {where}" + (f" ({', '.join(failed[:2])})" if failed else f" (exit code {r.returncode})")
    return "survived"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_build = os.path.join(ROOT, "build-mutation")
    ap.add_argument("--build", default=default_build,
                    help="a build folder configured without -Werror (default build-mutation/, configured if absent)")
    ap.add_argument("--mutants", default=os.path.join(ROOT, "scripts", "mutants.json"))
    ap.add_argument("ids", nargs="*", help="only these mutants")
    a = ap.parse_args(argv)
    cache = os.path.join(a.build, "CMakeCache.txt")
    if not os.path.isfile(cache) and os.path.abspath(a.build) == default_build:
        r = subprocess.run(["cmake", "-S", ROOT, "-B", a.build, "-DCMAKE_BUILD_TYPE=Release", "-DMOELAB_WERROR=OFF"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"configuring {a.build} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    if not os.path.isfile(cache):
        fail(f"--build {a.build}: not a configured build folder (no CMakeCache.txt)")
    if "MOELAB_WERROR:BOOL=ON" in open(cache, errors="replace").read():
        fail(f"--build {a.build}: configured with MOELAB_WERROR=ON, where a mutant's warning stops its build; "
             f"use a folder configured with -DMOELAB_WERROR=OFF")
    try:
        mutants = json.load(open(a.mutants))["mutants"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{a.mutants}: {e}")
    ids = [m.get("id") for m in mutants]
    for i in a.ids:
        if i not in ids:
            fail(f"no mutant {i!r} in {a.mutants}")
    chosen = [m for m in mutants if not a.ids or m["id"] in a.ids]
    # Every mutant must still apply: its piece of code found exactly once.
    for m in chosen:
        for key in ("id", "file", "old", "new", "tests"):
            if key not in m:
                fail(f"mutant {m.get('id', '?')}: no {key!r}")
        n = open(os.path.join(ROOT, m["file"])).read().count(m["old"])
        if n != 1:
            fail(f"mutant {m['id']}: its code is found {n} times in {m['file']} (the source changed: update {a.mutants})")
    unexplained, invalid, touched = [], [], set()
    for m in chosen:
        path = os.path.join(ROOT, m["file"])
        text = open(path).read()
        touched.update(m["tests"])
        t0 = time.time()
        try:
            open(path, "w").write(text.replace(m["old"], m["new"]))
            verdict = run_mutant(m, a.build)
        finally:
            open(path, "w").write(text)
        note = ""
        if verdict.startswith("invalid"):
            invalid.append(m["id"])
        if verdict == "survived":
            if m.get("survives"):
                note = f" (explained: {m['survives']})"
            else:
                unexplained.append(m["id"])
        print(f"{m['id']:5} {verdict}{note} [{time.time() - t0:.0f} s] {m['file']}: {m['old'][:70]!r}", flush=True)
    if touched and build(a.build, sorted(touched)).returncode != 0:
        print("mutation.py: rebuilding the unchanged sources failed", file=sys.stderr)
    print(f"mutation.py: {len(chosen)} mutants, {len(unexplained)} unexplained survivor(s)"
          + (f": {', '.join(unexplained)}" if unexplained else "")
          + f", {len(invalid)} invalid (not built, or no test binary)" + (f": {', '.join(invalid)}" if invalid else ""))
    return 1 if unexplained or invalid else 0


if __name__ == "__main__":
    sys.exit(main())
