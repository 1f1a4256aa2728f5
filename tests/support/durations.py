"""The suite's test durations, for the order its two workers take the tests in (conftest's
``pytest_collection_modifyitems``: the longest modules and groups first, so that neither worker
is left with a long one at the end while the other idles).

    python tests/support/durations.py CI_LOG...   # rewrites tests/durations.json

Each log is a pytest run's output with ``--durations=0`` (CI's, with ``PYTEST_ADDOPTS``): every
test's setup, call and teardown seconds, summed per test. A test missing from the file counts
as 0 s; an old file only orders the tests less well.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "durations.json"
LINE = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(\S+)$")


def main(logs: list[str]) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for log in logs:
        for line in Path(log).read_text().splitlines():
            if match := LINE.match(line.strip()):
                seconds[match.group(2).split("@")[0]] += float(match.group(1))
    rounded = {k: round(v, 2) for k, v in sorted(seconds.items()) if v >= 0.05}
    OUT.write_text(json.dumps(rounded, indent=0) + "\n")
    print(f"{OUT}: {len(rounded)} tests, {sum(rounded.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
