#!/usr/bin/env bash
# Installs parallel-tuner with every direct dependency at its floor (constraints/floors.txt) in a
# throwaway venv, prints what got installed, then runs ruff (lint and format check) and the fast
# test group against it (docs/dependencies.md). The project's .venv is never touched.
#
#   scripts/check-floors.sh                    # the working tree, at the floors
#   FLOORS_REF=HEAD scripts/check-floors.sh    # a clean export of a commit instead (git archive):
#                                              # what is committed, without anyone's edits in progress
#   FLOORS=other.txt scripts/check-floors.sh   # another constraints file (e.g. to try one floor)
#   KEEP_VENV=1 scripts/check-floors.sh        # keep the venv afterwards (its path is printed)
#   scripts/check-floors.sh tests/tuner        # arguments go to pytest (default: tests)
#
# Needs PyPI. The constraints pin each direct dependency with ==, so pip either installs exactly
# the floors or stops with ResolutionImpossible (two floors that cannot be installed together).
# Transitive dependencies are not pinned: pip takes the newest that fit the floors.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FLOORS=$(realpath "${FLOORS:-$ROOT/constraints/floors.txt}")
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/check-floors.XXXXXX")
VENV=$WORK/venv

cleanup() {
    if [[ ${KEEP_VENV:-0} == 1 ]]; then
        echo "check-floors: venv kept at $VENV"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

SRC=$ROOT
if [[ -n ${FLOORS_REF:-} ]]; then
    SRC=$WORK/src
    mkdir "$SRC"
    git -C "$ROOT" archive "$(git -C "$ROOT" rev-parse "$FLOORS_REF")" | tar -x -C "$SRC"
    echo "check-floors: testing $FLOORS_REF ($(git -C "$ROOT" rev-parse --short "$FLOORS_REF")), exported to $SRC"
fi

# pip's notes about local wheel folders that lack a package are dropped.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }

start=$(date +%s)
echo "check-floors: $("$PYTHON" --version), venv $VENV, constraints $FLOORS"
"$PYTHON" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install --quiet --upgrade pip
# -c: the floors; machine-wide pip constraints, where there are any, still apply on top.
quiet "$VENV/bin/python" -m pip install --quiet -c "$FLOORS" -e "$SRC[all,test]"
installed=$(date +%s)
status=0

echo "check-floors: installed in $((installed - start)) s; direct dependencies (pyproject bound, floor, installed):"
"$VENV/bin/python" - "$FLOORS" "$SRC/pyproject.toml" <<'PY' || status=1
import re
import sys
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

floors = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, pin = re.split(r"\s*==\s*", line)
        floors[canonicalize_name(name)] = (name, pin)
project = tomllib.load(open(sys.argv[2], "rb"))["project"]
extras = project["optional-dependencies"]
declared = [Requirement(r) for r in project["dependencies"] + [r for e in extras.values() for r in e]]
declared = [r for r in declared if canonicalize_name(r.name) != "parallel-tuner"]  # the `all` extra
declared = list({canonicalize_name(r.name): r for r in declared}.values())  # listed in two extras

bad = []
for req in declared:
    name = canonicalize_name(req.name)
    bound = next((s.version for s in req.specifier if s.operator in (">=", "==")), None)
    pin = floors.get(name, (None, None))[1]
    try:
        got = version(req.name)
    except PackageNotFoundError:
        got = "MISSING"
    notes = []
    # The floor is the bound itself, or the first release under it (bound 1.11 -> 1.11.1).
    if pin is None or bound is None or Version(pin) < Version(bound) or (
        Version(pin).release[: len(Version(bound).release)] != Version(bound).release
    ):
        notes.append(f"constraints say {pin}, pyproject says {req.specifier}")
    if pin is not None and got.split("+")[0] != pin:  # torch's CPU wheel is 2.13.0+cpu
        notes.append("not the floor")
    print(f"  {req.name:16} {str(req.specifier):10} {pin or '-':10} {got}" + (f"   <-- {'; '.join(notes)}" if notes else ""))
    bad += notes
sys.exit(1 if bad else 0)
PY

cd "$SRC"
echo "check-floors: ruff check . / ruff format --check . (make test, make lint)"
"$VENV/bin/ruff" check --no-cache --quiet . || status=1
"$VENV/bin/ruff" format --no-cache --check . || status=1

# The fast group (make test-fast), and "not slow" where pyproject declares that marker.
markers="not distributed and not slurm and not browser"
if grep -qE '^\s*"slow:' pyproject.toml; then
    markers="$markers and not slow"
fi
echo "check-floors: python -m pytest ${*:-tests} -m \"$markers\" -q -p no:cacheprovider"
"$VENV/bin/python" -m pytest "${@:-tests}" -m "$markers" -q -p no:cacheprovider || status=$?
end=$(date +%s)
echo "check-floors: exit $status; install $((installed - start)) s, checks and tests $((end - installed)) s, total $((end - start)) s"
exit $status
