"""The README's first command and CI install torch alike: the pinned version with the CPU index as
an extra index (its ``+cpu`` build is preferred; PyPI's is the fallback where only PyPI answers)."""

import re

from helpers import REPO


def test_the_first_command_and_ci_install_the_same_cpu_torch():
    readme = (REPO / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("\n```", 1)[0]
    pin = re.search(r"pip install (torch==\S+ --extra-index-url https://download\.pytorch\.org/whl/cpu)", first)
    assert pin, first
    ci = (REPO / ".ci" / "run").read_text()
    assert f"python -m pip install -q {pin.group(1)}\n" in ci
