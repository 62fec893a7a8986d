"""Tests of scripts/mutation.py's list (scripts/mutants.json) and its bad input; no build needed.

    /usr/bin/python3 -m unittest -v test_mutation      (from scripts/tests)

Every mutant must still apply to the source (its piece found exactly once), and name test
binaries that CMake registers; a source change that breaks one fails here, so the list is
mended with the code instead of going stale.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

import fixtures

SCRIPT = os.path.join(fixtures.SCRIPTS, "mutation.py")
MUTANTS = os.path.join(fixtures.SCRIPTS, "mutants.json")


def registered_tests():
    names = set()
    for d, dirs, files in os.walk(fixtures.ROOT):
        # Build folders (build, build-gpu, ...) and hidden ones are not source: not walked, so
        # files other tests create and delete there meanwhile cannot trip the walk.
        dirs[:] = [x for x in dirs if not x.startswith(("build", "."))]
        if "CMakeLists.txt" in files:
            text = open(os.path.join(d, "CMakeLists.txt")).read()
            names.update(re.findall(r"add_moelab(?:_mpi)?_test\((\w+)", text))
    return names


class MutantList(unittest.TestCase):
    def test_every_mutant_applies_and_names_registered_tests(self):
        mutants = json.load(open(MUTANTS))["mutants"]
        self.assertGreater(len(mutants), 0)
        ids = [m["id"] for m in mutants]
        self.assertEqual(len(ids), len(set(ids)), "mutant ids are unique")
        known = registered_tests()
        for m in mutants:
            with self.subTest(m["id"]):
                text = open(os.path.join(fixtures.ROOT, m["file"])).read()
                self.assertEqual(text.count(m["old"]), 1, f"{m['file']}: {m['old']!r}")
                self.assertNotEqual(m["old"], m["new"])
                self.assertTrue(m["tests"])
                for t in m["tests"]:
                    self.assertIn(t, known)
                if "survives" in m:
                    self.assertTrue(m["survives"].strip())


class BadInput(unittest.TestCase):
    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_a_folder_that_is_no_build_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            r = self.run_script("--build", d)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a configured build folder", r.stderr)

    def test_a_werror_build_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "CMakeCache.txt"), "w").write("MOELAB_WERROR:BOOL=ON\n")
            r = self.run_script("--build", d)
        self.assertEqual(r.returncode, 2)
        self.assertIn("MOELAB_WERROR=OFF", r.stderr)

    def test_an_unknown_id_and_a_bad_list_are_refused(self):
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "CMakeCache.txt"), "w").close()
            r = self.run_script("--build", d, "no-such-id")
            self.assertEqual(r.returncode, 2)
            self.assertIn("no mutant 'no-such-id'", r.stderr)
            bad = os.path.join(d, "m.json")
            open(bad, "w").write("{")
            r = self.run_script("--build", d, "--mutants", bad)
            self.assertEqual(r.returncode, 2)
            self.assertIn("m.json", r.stderr)
            open(bad, "w").write(json.dumps({"mutants": [{"id": "x", "file": "README.md", "old": "no such text here",
                                                          "new": "y", "tests": ["mpipemoe_test"]}]}))
            r = self.run_script("--build", d, "--mutants", bad)
            self.assertEqual(r.returncode, 2)
            self.assertIn("found 0 times", r.stderr)


if __name__ == "__main__":
    unittest.main()
