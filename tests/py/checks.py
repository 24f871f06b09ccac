"""checks.py: what the tests in tests/py share. check(what, ok, detail) counts a pass, or counts a
failure and prints "FAIL what: detail"; done(name) prints "NAME: N passed, N failed" and exits
non-zero if any failed. bench/ goes on the import path, so a test can import speed."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))

passed = failed = 0


def check(what, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {what}: {detail}")


def done(name):
    print(f"{name}: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
