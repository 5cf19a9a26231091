"""The mutation check's catalogue stays runnable: every planted bug's snippet occurs exactly once under moeflow/
and every test it names exists (scripts/mutation_check.py; `--list` had rotted when code moved in session 14)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import mutation_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.id)
def test_each_mutation_finds_its_snippet_once_and_names_existing_tests(mutation: mutation_check.Mutation) -> None:
    mutation_check.locate(mutation, ROOT)  # SystemExit naming the id when the snippet moved or doubled
    assert mutation.replacement != mutation.snippet
    for node in mutation.tests:
        assert (ROOT / node.split("::")[0]).is_file(), f"{mutation.id}: {node} does not exist"
