"""MkDocs hook (mkdocs.yml `hooks:`): pages and images made at build time, never committed twice.

- reference/proto.md from proto/kvservice/v1/allocator.proto (tools/docs/proto_ref.py);
- reference/cli.md from the argparse parsers (tools/docs/cli_ref.py);
- operations/ray.md and operations/monitoring.md from deploy/README.md and deploy/monitoring/README.md
  (their links to the manifests beside them become the files' paths: the site does not serve them);
- every PNG under bench/results/, served at the same path, so a page links `bench/results/X.png` as the
  README does.
Nothing is written into docs/: the files exist only in the build.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import re  # noqa: E402

import cli_ref  # noqa: E402
import proto_ref  # noqa: E402

LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|#)([^)#]+)[^)]*\)")


def from_checkout(path: str):
    """A Markdown file of the checkout as a page: a link to a file beside it becomes that file's path."""
    def page() -> str:
        folder = str(Path(path).parent)
        def as_path(m: re.Match) -> str:
            target = f"{folder}/{m[2]}"
            return f"`{target}`" if m[1].strip("`") in (m[2], target) else f"{m[1]} (`{target}`)"
        return LINK.sub(as_path, (ROOT / path).read_text())
    return page


GENERATED_PAGES = {"reference/proto.md": proto_ref.page, "reference/cli.md": cli_ref.page,
                   "operations/ray.md": from_checkout("deploy/README.md"),
                   "operations/monitoring.md": from_checkout("deploy/monitoring/README.md")}


def on_files(files: Files, config) -> Files:
    for uri, make in GENERATED_PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"bench/results/{png.name}", abs_src_path=str(png)))
    return files
