"""`make test-vllm`: vLLM 0.33.0's own KV-cache core tests, on vLLM itself and on kvservice's drop-in.

    python tests/vllm/run.py [--env DIR] [--side both|vllm|dropin] [-k EXPR] [--fresh-baseline]

Runs `tests/v1/core/{test_prefix_caching,test_kv_cache_utils,test_single_type_kv_cache_manager}.py` from
vLLM's sdist (built into DIR by tools/vllm_env.sh) under DIR's venv, once with vLLM's own classes (the
baseline, cached per test-file digest) and once with vLLM's names replaced by
`kvservice.integrations.vllm.core` (tests/vllm/vllm_dropin_conftest.py), then prints pass/fail counts per
file. Exits 1 when a test that passes on vLLM fails on the drop-in, unless tests/vllm/exclusions.txt
lists it (each line: a test id prefix, then `#` and why it exercises no core state).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FILES = ("test_prefix_caching.py", "test_kv_cache_utils.py", "test_single_type_kv_cache_manager.py")
DEFAULT_ENV = Path(os.environ.get("VLLM_ENV", Path.home() / ".cache/kvservice/vllm-0.33.0"))


def load_exclusions(name: str = "exclusions.txt") -> dict[str, str]:
    """tests/vllm/`name`: test id prefix -> why (each line: the prefix, then `#` and the reason)."""
    out = {}
    for line in (HERE / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            test, _, why = line.partition("#")
            out[test.strip()] = why.strip()
    return out


def run_side(env_dir: Path, side: str, keyword: str | None, timeout: int) -> dict[str, str]:
    """test id -> "passed" | "failed" | "skipped" for one side."""
    root = env_dir / "tests"
    core_dir = root / "tests/v1/core"
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "junit.xml"
        cmd = [str(env_dir / "venv/bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "vllm_dropin_conftest", f"--confcutdir={core_dir}", f"--junitxml={xml_path}",
               "-o", "junit_family=xunit1", f"--timeout={timeout}", "--rootdir", str(root),
               *[str(core_dir / f) for f in FILES]]
        if keyword:
            cmd += ["-k", keyword]
        # vLLM's tests package first: `tests.v1.core.utils` is vLLM's, not this project's `tests`.
        path = os.pathsep.join([str(root), str(HERE), str(REPO), str(env_dir / "src")])
        env = dict(os.environ, PYTHONPATH=path, KVSERVICE_VLLM_SIDE=side, VLLM_TARGET_DEVICE="cpu",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        if not xml_path.exists():
            sys.stdout.write(proc.stdout[-4000:])
            raise SystemExit(f"{side}: pytest produced no report (exit {proc.returncode})")
        return parse_junit(xml_path)


def parse_junit(path: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = Path(case.get("file", "")).name or case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        test_id = f"{file}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            out[test_id] = "failed"
        elif "skipped" in kinds:
            out[test_id] = "skipped"
        else:
            out[test_id] = "passed"
    return out


def baseline(env_dir: Path, keyword: str | None, fresh: bool, timeout: int) -> dict[str, str]:
    digest = hashlib.sha256()
    for f in FILES:
        digest.update((env_dir / "tests/tests/v1/core" / f).read_bytes())
    digest.update(str(keyword).encode())
    cache = env_dir / f"baseline-{digest.hexdigest()[:16]}.json"
    if cache.exists() and not fresh:
        return json.loads(cache.read_text())
    results = run_side(env_dir, "vllm", keyword, timeout)
    cache.write_text(json.dumps(results, indent=0, sort_keys=True))
    return results


def count(results: dict[str, str], file: str) -> tuple[int, int]:
    mine = [v for k, v in results.items() if k.startswith(file + "::")]
    return sum(v == "passed" for v in mine), len(mine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", type=Path, default=DEFAULT_ENV)
    parser.add_argument("--side", choices=("both", "vllm", "dropin"), default="both")
    parser.add_argument("-k", dest="keyword")
    parser.add_argument("--fresh-baseline", action="store_true")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--list", action="store_true", help="list every vLLM-passing test the drop-in fails")
    args = parser.parse_args()
    if not (args.env / "venv/bin/python").exists():
        raise SystemExit(f"no vLLM environment at {args.env}: run `make vllm-env` (tools/vllm_env.sh)")
    theirs = baseline(args.env, args.keyword, args.fresh_baseline, args.timeout) if args.side != "dropin" else {}
    ours = run_side(args.env, "dropin", args.keyword, args.timeout) if args.side != "vllm" else {}
    excluded = load_exclusions()

    def is_excluded(test_id: str) -> bool:
        return any(test_id.startswith(prefix) for prefix in excluded)

    missing = sorted(t for t, v in theirs.items() if v == "passed" and ours.get(t) != "passed" and not is_excluded(t))
    rows = [("file", "vLLM passed/total", "drop-in passed/total", "vLLM-passing, excluded",
             "vLLM-passing, drop-in failing")]
    for f in FILES:
        p1, n1 = count(theirs, f)
        p2, n2 = count(ours, f)
        num_excluded = sum(1 for t, v in theirs.items() if t.startswith(f + "::") and is_excluded(t)
                           and v == "passed" and ours.get(t) != "passed")
        rows.append((f, f"{p1}/{n1}", f"{p2}/{n2}", str(num_excluded),
                     str(sum(1 for t in missing if t.startswith(f + "::")))))
    p1, n1 = sum(v == "passed" for v in theirs.values()), len(theirs)
    p2, n2 = sum(v == "passed" for v in ours.values()), len(ours)
    num_excluded = sum(1 for t, v in theirs.items() if is_excluded(t) and v == "passed" and ours.get(t) != "passed")
    rows.append(("all", f"{p1}/{n1}", f"{p2}/{n2}", str(num_excluded), str(len(missing))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if args.list:
        for t in missing:
            print("  MISSING", t)
    if args.side != "both":
        return 0
    if missing:
        print(f"{len(missing)} tests pass on vLLM 0.33.0 but not on the drop-in (run with --list)")
        return 1
    print("every test that passes on vLLM 0.33.0 passes on the drop-in (exclusions aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
