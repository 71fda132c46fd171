"""docs/DESIGN.md against the code where a list of names can drift: the candidate table names the
candidate modules there are, and the extras it describes are the ones pyproject.toml declares."""

import re
import tomllib

from helpers import REPO

from harness.candidates import MODULES

DESIGN = (REPO / "docs" / "DESIGN.md").read_text()


def test_the_candidate_table_lists_exactly_the_candidate_modules():
    section = DESIGN.split("## 6. Candidates", 1)[1].split("\n## ", 1)[0]
    ids = re.findall(r"^\| (H\d[a-z]) ", section, flags=re.M)
    assert sorted(ids) == sorted(MODULES)


def test_every_optional_extra_is_described():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    deps = DESIGN.split("Dependencies, chosen for the field:", 1)[1].split("\n\n", 1)[0]
    for name in set(extras) - {"dev"}:
        assert f"`{name}`" in deps, name
