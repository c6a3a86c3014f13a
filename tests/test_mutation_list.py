"""fuzz/mutation.py's list of planted bugs stays applicable to the tree (it cannot rot)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutation", ROOT / "fuzz" / "mutation.py")
mutation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation)


def test_every_mutant_applies_exactly_once():
    assert mutation.check(mutation.MUTANTS) == []
    assert len(mutation.MUTANTS) >= 15


def test_check_names_a_stale_or_duplicate_mutant(tmp_path):
    m = mutation.MUTANTS[0]
    stale = m._replace(old=m.old + " /* not in the file */")
    assert mutation.check([stale]) == [f"{m.name}: its text occurs 0 times in {m.path}"]
    assert mutation.check([m, m]) == [f"{m.name}: named twice"]


def test_cli_lists_and_refuses_unknown_names(capsys):
    assert mutation.main(["--list"]) == 0
    assert "cow-no-copy" in capsys.readouterr().out
    assert mutation.main(["no-such-mutant"]) == 2
    assert "unknown mutants: no-such-mutant" in capsys.readouterr().err


def test_cli_refuses_a_tests_target_that_does_not_exist(capsys):
    """A wrong --tests would make pytest fail on every mutant: refused before any build."""
    assert mutation.main(["cow-no-copy", "--tests", "tests/no_such_file.py"]) == 2
    assert "--tests tests/no_such_file.py: no such file" in capsys.readouterr().err
