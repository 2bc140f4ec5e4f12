"""The deliberate bugs of `make mutants` (tests/mutants/mutants.py) still apply: each one's line is in its file once,
so that a refactor cannot turn a mutant into a no-op that every test then "catches"."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "mutants"))
import mutants  # noqa: E402


def test_every_mutant_changes_exactly_one_place_of_its_file():
    found = {m.name: (REPO / m.path).read_text().count(m.before) for m in mutants.MUTANTS}
    assert found == dict.fromkeys(found, 1), {name: n for name, n in found.items() if n != 1}
    assert all(m.before != m.after for m in mutants.MUTANTS)
