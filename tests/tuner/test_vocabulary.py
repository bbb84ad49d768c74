"""One vocabulary of study and trial states, spelled out only in tuner/outcome.py: no raw status
literal anywhere else in the Python sources, every public word parses back, older words too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tuner.outcome import OLDER_STUDY_WORDS, StudyStatus, TrialState, words

ROOT = Path(__file__).resolve().parents[2]
# tuner/dispatch speaks the scheduler's job states (Slurm's PENDING, RUNNING, CANCELLED, ...: a
# JobReport's `state`), a vocabulary of its own that never names a study or a trial; trainer/ knows
# no study or trial (its BenchmarkResult statuses, e.g. 'pruned', are mapped by outcome.classify).
SCANNED = ("tuner", "api", "bench")
EXEMPT = ("tuner/outcome.py", "tuner/dispatch/")
# The stored values, the words and the older words ('fail', a lower-cased stored value that parse()
# also takes, is the own tables' word for a failed run: bench/validation_data.py).
FORBIDDEN = frozenset(
    {m.value for m in (*StudyStatus, *TrialState)}
    | {*words(StudyStatus).values(), *words(TrialState).values()}
    | set(OLDER_STUDY_WORDS)
)
# A status quoted inside a longer string: SQL (`state = 'COMPLETE'`), a JS or JSON snippet.
QUOTED = re.compile(r"""['"](""" + "|".join(sorted(FORBIDDEN, key=len, reverse=True)) + r""")['"]""")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (documentation may name states; values may not)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def raw_status_literals(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
            continue
        if node.value in FORBIDDEN or QUOTED.search(node.value):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value[:60]!r}")
    return found


def sources() -> list[Path]:
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if not str(p.relative_to(ROOT)).startswith(EXEMPT)]


def test_no_raw_study_or_trial_status_literal_outside_the_enums() -> None:
    found = [hit for path in sources() for hit in raw_status_literals(path)]
    assert not found, "spell states through tuner/outcome.py's enums:\n" + "\n".join(found)


def test_the_scan_finds_a_raw_status(tmp_path: Path) -> None:
    """The scan itself: a value, an SQL string and a word are found; a docstring is not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""A module that says PENDING in its docstring."""\n'
        'A = "COMPLETE"\nB = "SELECT 1 FROM trials WHERE state = \'FAIL\'"\nC = {"done": 1}\n'
        "def f():\n    'RUNNING, in a docstring'\n    return 'x'\n"
    )
    hits = raw_status_literals(probe, tmp_path)
    assert [h.split(": ", 1)[1] for h in hits] == [
        "'COMPLETE'",
        "\"SELECT 1 FROM trials WHERE state = 'FAIL'\"",
        "'done'",
    ]


def test_every_state_has_one_lower_case_word_and_parses_back() -> None:
    for cls in (StudyStatus, TrialState):
        assert set(words(cls)) == set(cls)
        for member, word in words(cls).items():
            assert word == word.lower() and member.word == word
            assert cls.parse(word) is member and cls.parse(member.value) is member  # stored value
            assert cls.parse(word.upper()) is member  # any case
    # The words studies and trials share mean the same thing.
    assert StudyStatus.COMPLETE.word == TrialState.COMPLETE.word == "complete"
    assert StudyStatus.FAILED.word == TrialState.FAIL.word == "failed"


@pytest.mark.parametrize(
    ("cls", "old", "member"),
    [
        (StudyStatus, "done", StudyStatus.COMPLETE),
        (TrialState, "FAIL", TrialState.FAIL),
        (TrialState, "COMPLETE", TrialState.COMPLETE),
    ],
)
def test_older_words_are_accepted(cls, old: str, member) -> None:
    assert cls.parse(old) is member


def test_an_unknown_word_names_the_vocabulary() -> None:
    with pytest.raises(
        ValueError, match=r"'finished' is not one of waiting, submitting, .*older words accepted: fail"
    ):
        TrialState.parse("finished")


STATIC = ROOT / "api" / "static"
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)


def test_the_dashboard_spells_no_state_and_styles_every_word() -> None:
    """The page takes its words from /static/vocabulary.js (api/dashboard.py writes it from the
    enums); its stylesheet has a badge for every study word and row styles only for trial words."""
    for path in sorted(STATIC.glob("*.js")):
        code = COMMENT.sub("", path.read_text())
        assert not QUOTED.findall(code), f"{path.name} spells states: {sorted(set(QUOTED.findall(code)))}"
    css = COMMENT.sub("", (STATIC / "style.css").read_text())
    assert set(re.findall(r"\.badge\.([a-z]+)", css)) == set(words(StudyStatus).values())
    rows = set(re.findall(r"table\.trials (?:tbody )?tr\.([a-z]+)", css)) - {"selected"}
    assert rows <= set(words(TrialState).values()), rows - set(words(TrialState).values())


def test_the_vocabulary_module_is_written_from_the_enums() -> None:
    from api.dashboard import vocabulary_js

    js = vocabulary_js()
    for cls, name in ((StudyStatus, "STUDY"), (TrialState, "TRIAL")):
        assert f"export const {name} = " in js
        for member in cls:
            assert f'"{member.name}": "{member.word}"' in js
    assert 'export const LIVE_STUDY = Object.freeze(["pending", "running", "cancelling"])' in js
    assert 'export const FINISHED_TRIAL = Object.freeze(["complete", "pruned", "failed"])' in js
