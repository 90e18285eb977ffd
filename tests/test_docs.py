"""The docs name tests as evidence (RELIABILITY.md, COORDINATOR.md, ...): every test they name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
        *(p for p in ROOT.glob("*/README.md") if not p.parent.name.startswith(".")),
    ]
)  # not .pytest_cache
REF = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_a_doc_names_exists(doc):
    missing = []
    for path, name in REF.findall(doc.read_text()):
        target = ROOT / path
        if not target.exists():
            missing.append(path)
        elif name and not re.search(rf"def {name}\(", target.read_text()):
            missing.append(f"{path}::{name}")
    assert not missing, f"{doc.relative_to(ROOT)} names tests that do not exist: {sorted(set(missing))}"
