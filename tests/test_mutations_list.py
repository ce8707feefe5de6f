"""tests/mutations.py's list stays applicable: each mutation's text occurs exactly once in the file it mutates, so
``python tests/mutations.py`` (docs/testing.md) mutates what its table says instead of failing on a stale row."""

from __future__ import annotations

import pytest
from mutations import MUTATIONS, ROOT


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_text_occurs_once_in_its_file(name):
    path, replacements, tests = MUTATIONS[name]
    text = (ROOT / path).read_text()
    for old, _ in replacements:
        assert text.count(old) == 1, f"{name}: {old!r} occurs {text.count(old)} times in {path}"
    for test in tests:
        assert (ROOT / test).is_file(), f"{name}: no test file {test}"
