"""The protocol's link table in experiments/results/links/README.md is what its step times and
measured costs per row give, each task labelled by the regime those costs say."""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINKS = ROOT / "experiments" / "results" / "links"


def _protocol_links():
    spec = importlib.util.spec_from_file_location("protocol_links", LINKS / "protocol_links.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_holds_the_summary_the_step_times_give_with_each_regime_measured():
    """When it fails: ``python experiments/results/links/protocol_links.py summary`` into the
    README's table."""
    links = _protocol_links()
    table = links._summary()
    assert table in (LINKS / "README.md").read_text()
    costs = json.loads((LINKS / "cost_per_row.json").read_text())
    for row in links._rows():
        per = costs[row["task"]]
        rows = sorted(per, key=int)
        bound = per[rows[0]] <= 1.25 * per[rows[-1]]
        assert row["regime"] == ("compute-bound" if bound else "dispatch-bound"), row["task"]
