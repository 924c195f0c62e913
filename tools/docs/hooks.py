"""MkDocs hook (mkdocs.yml `hooks:`): pages and images made at build time, never committed twice.

- reference/proto.md from proto/kvservice/v1/allocator.proto (tools/docs/proto_ref.py);
- reference/cli.md from the argparse parsers (tools/docs/cli_ref.py);
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

import cli_ref  # noqa: E402
import proto_ref  # noqa: E402

GENERATED_PAGES = {"reference/proto.md": proto_ref.page, "reference/cli.md": cli_ref.page}


def on_files(files: Files, config) -> Files:
    for uri, make in GENERATED_PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"bench/results/{png.name}", abs_src_path=str(png)))
    return files
