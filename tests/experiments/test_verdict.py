"""The README's verdict: every figure it quotes is the value the verdict file holds under the
key the figure names, and the verdict file is what the results in the repository give."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from pipemare.experiments.studies import verdict

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: a figure quoted from the verdict file: [TEXT](experiments/results/verdict.json "KEY")
QUOTE = re.compile(r'\[([^\]]+)\]\(experiments/results/verdict\.json "([^"]+)"\)')


def _value(data: dict, key: str):
    for part in key.split("."):
        data = data[part]
    return data


def _shown(text: str, value) -> str:
    """``value`` written the way the README's ``text`` writes its figure: a signed or unsigned
    percentage, a ratio with ×, a count (thousands with commas), or ``never`` for null."""
    text = text.replace("−", "-")
    if text == "never":
        return "never" if value is None else repr(value)
    if value is None:
        return "null"
    if text.endswith("%"):
        signed = text[0] in "+-"
        return f"{100 * value:+.1f}%" if signed else f"{100 * abs(value):.1f}%"
    if text.endswith("×"):
        return f"{value:.2f}×"
    return f"{value:,}"


def test_the_verdict_file_is_what_the_results_give():
    """When it fails: ``python -P experiments/studies/verdict.py`` (after the results moved)."""
    shipped = json.loads(verdict.OUT.read_text())
    assert json.loads(json.dumps(verdict.build_verdict(ROOT))) == shipped
    for name, entry in shipped.items():
        if isinstance(entry, dict):
            assert (ROOT / entry["source"]).exists(), name


def test_every_figure_the_readme_quotes_is_the_verdict_files():
    readme = (ROOT / "README.md").read_text()
    data = json.loads(verdict.OUT.read_text())
    quotes = QUOTE.findall(readme)
    assert len(quotes) >= 20  # the verdict paragraph quotes, not restates
    for text, key in quotes:
        assert _shown(text, _value(data, key)) == text.replace("−", "-"), (text, key)


@pytest.mark.parametrize(
    ("text", "value", "ok"),
    [
        ("−0.5%", -0.0049, True),
        ("+0.5%", -0.0049, False),
        ("0.5%", -0.0049, True),
        ("0.90×", 0.8988, True),
        ("0.91×", 0.8988, False),
        ("never", None, True),
        ("never", 1.2, False),
        ("2,400", 2400, True),
        ("17", 18, False),
    ],
)
def test_a_quoted_figure_must_match_its_value(text, value, ok):
    assert (_shown(text, value) == text.replace("−", "-")) is ok
