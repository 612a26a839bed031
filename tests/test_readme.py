"""The README is a user guide that runs as pasted: its Python blocks run on the bundled model (the
ones that need a server run against `vskipper serve` in tests/test_serve.py), it stays short, it
holds no dated measurements, and every file it links exists."""
from __future__ import annotations

import re

import pytest

from helpers import README, readme_blocks, run_block


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(readme_blocks(server=False))))
def test_readme_python_block_runs_as_pasted(i, tmp_path):
    run_block(readme_blocks(server=False)[i], tmp_path)


def test_readme_is_a_short_guide_with_live_links_and_no_dates():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert not re.findall(r"20\d\d-[01]\d-[0-3]\d", text), "dated results belong in docs/results/"
    assert readme_blocks(server=False) and readme_blocks(server=True)
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (README.parent / target).exists(), f"README links {target}, which does not exist"
