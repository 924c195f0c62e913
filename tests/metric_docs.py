"""The metric series the docs name (README.md, docs/, deploy/): every `kvservice_*` and `vllm:kvservice_*` name
with the labels its selector names, for the tests that check them against what real processes export
(tests/test_monitoring_kit.py: the allocator's; tests/vllm/test_connector_observability.py: the connector's)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A whole name (a family such as `kvservice_external_*` or `kvservice_pool_` is not one), then its selector.
NAME = re.compile(r"(?<![\w:])((?:vllm:)?kvservice_[a-z0-9_]*[a-z0-9])(?![\w*])(\{[^}`]*\})?")
LABEL = re.compile(r"^\s*([a-zA-Z_]\w*)\s*(?:[=!]~?|$)")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "deploy").rglob("*.md"))]


def named_series() -> dict[str, dict[str, set[str]]]:
    """Series name -> where it is named (`path:line`) -> the label names its selectors there use."""
    found: dict[str, dict[str, set[str]]] = {}
    for path in doc_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in NAME.finditer(line):
                where = f"{path.relative_to(REPO)}:{number}"
                labels = found.setdefault(m[1], {}).setdefault(where, set())
                for part in (m[2] or "{}")[1:-1].split(","):
                    label = LABEL.match(part)
                    if label:
                        labels.add(label[1])
    return found


def is_connectors(name: str) -> bool:
    """The connector's series (exported by vLLM's /metrics), not the allocator's."""
    return name.startswith("vllm:") or name.startswith("kvservice_page_checksum_failures")


def is_routers(name: str) -> bool:
    """`kvservice route`'s series (exported by the router's /metrics), not the allocator's."""
    return name.startswith("kvservice_router_")


def unexported(named: dict[str, dict[str, set[str]]], exported: dict[str, set[str]]) -> list[str]:
    """What the docs name that `exported` (sample name -> its label names) lacks: a name (a histogram's by its
    base name), or a label of it."""
    wrong = []
    for name, places in sorted(named.items()):
        labels = exported.get(name)
        if labels is None and f"{name}_bucket" in exported:
            labels = exported[f"{name}_bucket"] - {"le"}
        for where, used in sorted(places.items()):
            if labels is None:
                wrong.append(f"{where}: {name} is not exported")
            elif used - labels:
                wrong.append(f"{where}: {name} has no label {', '.join(sorted(used - labels))} "
                             f"(it has {', '.join(sorted(labels)) or 'none'})")
    return wrong
