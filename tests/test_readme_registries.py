"""The README's lists of codecs and aggregation rules (its Options table) name exactly what the
registries hold: a codec or rule added without its README entry, or a README entry left behind, fails
here (test_codecs.py and test_rules.py check that the registries hold what their packages define)."""

from __future__ import annotations

import re
from pathlib import Path

from swarmgrad.averaging.codecs import CODEC_NAMES, get_codec
from swarmgrad.averaging.rules import RULE_NAMES

README = Path(__file__).resolve().parent.parent / "README.md"


def options_row(argument: str) -> str:
    """The values cell of ``argument``'s row in the README's Options table."""
    rows = re.findall(rf"^\| `{argument}` \| (.*?) \| .* \|$", README.read_text(), re.MULTILINE)
    assert len(rows) == 1, f"the README's Options table should have one `{argument}` row, found {len(rows)}"
    return rows[0]


def quoted_names(cell: str) -> list[str]:
    """The names in a cell of quoted specs: ``"topk:0.01"`` is topk."""
    return [spec.split(":")[0] for spec in re.findall(r'`"([^"`]+)"`', cell)]


def test_the_readme_lists_every_codec_and_no_other():
    listed = quoted_names(options_row("compression"))
    assert sorted(listed) == sorted(CODEC_NAMES) and len(listed) == len(set(listed)), listed
    for name in listed:
        get_codec(name)  # each is usable as written


def test_the_readme_lists_every_aggregation_rule_and_no_other():
    listed = quoted_names(options_row("aggregator"))
    assert sorted(listed) == sorted(RULE_NAMES) and len(listed) == len(set(listed)), listed
