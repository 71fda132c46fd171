"""Builders and checks shared by the test folders, imported by name (``from helpers.events import …``:
the root ``conftest.py`` puts ``tests/`` on the import path). The fixtures built on them are in
``tests/conftest.py``; what only one folder uses stays in that folder."""

from pathlib import Path

#: the checkout the tests run from (``python -m harness`` subprocesses start here)
REPO = Path(__file__).resolve().parents[2]
