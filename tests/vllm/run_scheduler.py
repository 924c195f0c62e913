"""`make test-vllm`: vLLM 0.33.0's own scheduler tests, on vLLM itself and on kvservice's schedulers.

    python tests/vllm/run_scheduler.py [--env DIR] [--side both|vllm|kvservice] [-k EXPR] [--list]
                                       [--fresh-baseline]

Runs FILES of `tests/v1/core/` from vLLM's sdist (built into DIR by tools/vllm_env.sh) under DIR's venv,
once with vLLM's own schedulers (the baseline, cached per test-file digest) and once with vLLM's
`Scheduler` / `AsyncScheduler` replaced by kvservice.integrations.vllm's, each allocating from a real
`kvservice serve` and checked against it after every test (tests/vllm/vllm_scheduler_shim.py); prints
pass/fail counts per file. `--list` names every test that passes on vLLM and fails on kvservice with the
first line of its failure, and counts them by kind of failure. Exits 1 when a test that passes on vLLM
fails on kvservice, unless tests/vllm/scheduler_exclusions.txt lists it (each line: a test id prefix, then
`#` and the vLLM refusal that puts it out of scope).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from run import load_exclusions  # tests/vllm/run.py: the core tests' runner, beside this one

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CORE = "tests/tests/v1/core"  # under DIR
FILES = ("test_scheduler.py", "test_async_scheduler.py", "test_deferred_block_free.py", "test_prefix_replay.py",
         "test_swa_inflight_window_free.py", "test_worker_slot_overflow.py", "test_prefix_caching.py",
         "test_priority_scheduler_random.py", "test_priority_preemption_bug.py")
HELPERS = ("utils.py",)  # imported by the files: part of the baseline's digest
DEFAULT_ENV = Path(os.environ.get("VLLM_ENV", Path.home() / ".cache/kvservice/vllm-0.33.0"))
# The Hugging Face configs the tests' models need, given to both sides as an offline hub cache (the
# schedulers read only the config; no weights, no tokenizer). The multimodal and hybrid models the other tests
# name (LLaVA, Qwen2.5-VL, Qwen3-Next) are left out: vLLM inspects their architectures in a subprocess that
# imports vllm._C, which the CPU environment lacks, so they fail on both sides anyway.
_OPT = {"activation_dropout": 0.0, "activation_function": "relu", "architectures": ["OPTForCausalLM"],
        "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True, "dropout": 0.1,
        "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0,
        "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
        "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272,
        "word_embed_proj_dim": 768}
HF_CONFIGS = {"facebook/opt-125m": _OPT,
              "facebook/opt-350m": {**_OPT, "do_layer_norm_before": False, "ffn_dim": 4096, "hidden_size": 1024,
                                    "num_attention_heads": 16, "num_hidden_layers": 24, "word_embed_proj_dim": 512}}
# Kinds of failure for --list, by a string the message holds: the earliest of CATEGORIES in the message (a
# start-up refusal lists the settings in this order), else the first of FALLBACKS it holds.
CATEGORIES = ("kv_transfer_config", "ec_transfer_config", "is_encoder_decoder", "speculative_config",
              "num_hash_lookahead_tokens", "num_prefill_lookahead", "aux_output_config", "hash_block_size =",
              "prefix_replay_tokens", "prefill_context_parallel_size", "hisparse_host_num_blocks", "is_eagle_group",
              "the allocator's pools carry", "extra_retained_tokens", "decode_context_parallel_size",
              "NotImplementedError: kvservice: deferred", "was added without block hashes",
              "hashes at hash block size", "free blocks after the step", "has (free, cached) blocks",
              "the scheduler's replica with")
FALLBACKS = ("kvservice pool check", "NotImplementedError", "PoolDiverged", "UnsupportedConfig", "Timeout")


def present_files(env_dir: Path) -> list[str]:
    return [f for f in FILES if (env_dir / CORE / f).exists()]


def hf_hub(env_dir: Path) -> Path:
    """An offline Hugging Face hub cache holding HF_CONFIGS (rewritten each run)."""
    hub = env_dir / "scheduler-hf-hub"
    revision = "0" * 40
    for repo, config in HF_CONFIGS.items():
        model = hub / ("models--" + repo.replace("/", "--"))
        (model / "snapshots" / revision).mkdir(parents=True, exist_ok=True)
        (model / "refs").mkdir(exist_ok=True)
        (model / "refs/main").write_text(revision)
        (model / "snapshots" / revision / "config.json").write_text(json.dumps(config, indent=1))
    return hub


def run_side(env_dir: Path, side: str, files: list[str], keyword: str | None,
             timeout: int) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, failure message) for one side; outcome "passed" | "failed" | "skipped"."""
    root = env_dir / "tests"
    core_dir = env_dir / CORE
    with tempfile.TemporaryDirectory(prefix=f"kvservice-sched-{side}-") as tmp:
        xml_path = Path(tmp) / "junit.xml"
        cmd = [str(env_dir / "venv/bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "vllm_scheduler_shim", f"--confcutdir={core_dir}", f"--junitxml={xml_path}",
               "-o", "junit_family=xunit1", f"--timeout={timeout}", "--rootdir", str(root),
               f"--basetemp={Path(tmp) / 'bt'}", *[str(core_dir / f) for f in files]]
        if keyword:
            cmd += ["-k", keyword]
        # vLLM's tests package first: `tests.v1.core.utils` is vLLM's, not this project's `tests`.
        path = os.pathsep.join([str(root), str(HERE), str(REPO), str(env_dir / "src")])
        env = dict(os.environ, PYTHONPATH=path, KVSERVICE_VLLM_SIDE=side, VLLM_TARGET_DEVICE="cpu",
                   HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hf_hub(env_dir)), TRANSFORMERS_OFFLINE="1",
                   VLLM_LOGGING_LEVEL="ERROR")
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        if not xml_path.exists():
            sys.stdout.write(proc.stdout[-4000:])
            raise SystemExit(f"{side}: pytest produced no report (exit {proc.returncode})")
        return parse_junit(xml_path)


def parse_junit(path: Path) -> dict[str, tuple[str, str]]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = Path(case.get("file", "")).name or case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        test_id = f"{file}::{case.get('name')}"
        bad = [child for child in case if child.tag in ("failure", "error")]
        if bad:
            out[test_id] = ("failed", bad[0].get("message") or (bad[0].text or "").strip())
        elif any(child.tag == "skipped" for child in case):
            out[test_id] = ("skipped", "")
        else:
            out[test_id] = ("passed", "")
    return out


def baseline(env_dir: Path, files: list[str], keyword: str | None, fresh: bool,
             timeout: int) -> dict[str, tuple[str, str]]:
    digest = hashlib.sha256()
    for f in (*files, *HELPERS):
        digest.update(f.encode())
        digest.update((env_dir / CORE / f).read_bytes())
    digest.update(json.dumps([HF_CONFIGS, keyword], sort_keys=True).encode())
    cache = env_dir / f"scheduler-baseline-{digest.hexdigest()[:16]}.json"
    if cache.exists() and not fresh:
        return {t: tuple(v) for t, v in json.loads(cache.read_text()).items()}
    results = run_side(env_dir, "vllm", files, keyword, timeout)
    cache.write_text(json.dumps(results, indent=0, sort_keys=True))
    return results


def summary(message: str) -> str:
    """The first line of a failure; for a start-up refusal, the settings it lists after it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    first = lines[0]
    if first.endswith("unset:"):
        first += " " + "; ".join(line for line in lines[1:] if not line.startswith(("E ", "File ")))
    return first if len(first) <= 300 else first[:297] + "..."


def category(message: str) -> str:
    found = [(message.find(c), i, c) for i, c in enumerate(CATEGORIES) if c in message]
    if found:
        return min(found)[2]
    for fallback in FALLBACKS:
        if fallback in message:
            return fallback
    first = summary(message)
    return "other: " + re.sub(r"\d+", "N", first)[:100]


def count(results: dict[str, tuple[str, str]], file: str) -> tuple[int, int]:
    mine = [v[0] for k, v in results.items() if k.startswith(file + "::")]
    return sum(v == "passed" for v in mine), len(mine)


def table(files: list[str], theirs: dict, ours: dict, missing: list[str], excluded_ids: list[str]) -> None:
    rows = [("file", "stock passed/total", "kvservice passed/total", "stock-passing, excluded",
             "stock-passing, kvservice failing")]

    def row(name: str, prefix: str) -> tuple[str, ...]:
        mine = {k: v for k, v in theirs.items() if k.startswith(prefix)}
        other = {k: v for k, v in ours.items() if k.startswith(prefix)}
        p1, n1 = sum(v[0] == "passed" for v in mine.values()), len(mine)
        p2, n2 = sum(v[0] == "passed" for v in other.values()), len(other)
        return (name, f"{p1}/{n1}", f"{p2}/{n2}", str(sum(t.startswith(prefix) for t in excluded_ids)),
                str(sum(t.startswith(prefix) for t in missing)))

    rows += [row(f, f + "::") for f in files]
    rows.append(row("all", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", type=Path, default=DEFAULT_ENV)
    parser.add_argument("--side", choices=("both", "vllm", "kvservice"), default="both")
    parser.add_argument("-k", dest="keyword")
    parser.add_argument("--fresh-baseline", action="store_true")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--list", action="store_true",
                        help="list every vLLM-passing test kvservice fails, with its message, and count them by kind")
    args = parser.parse_args()
    if not (args.env / "venv/bin/python").exists():
        raise SystemExit(f"no vLLM environment at {args.env}: run `make vllm-env` (tools/vllm_env.sh)")
    files = present_files(args.env)
    for f in sorted(set(FILES) - set(files)):
        print(f"not in vLLM's sdist, skipped: tests/v1/core/{f}")
    if not files:
        raise SystemExit(f"none of the scheduler test files is in {args.env / CORE}")
    theirs = baseline(args.env, files, args.keyword, args.fresh_baseline, args.timeout) \
        if args.side != "kvservice" else {}
    ours = run_side(args.env, "kvservice", files, args.keyword, args.timeout) if args.side != "vllm" else {}
    excluded = load_exclusions("scheduler_exclusions.txt")

    def is_excluded(test_id: str) -> bool:
        return any(test_id.startswith(prefix) for prefix in excluded)

    lost = sorted(t for t, v in theirs.items() if v[0] == "passed" and ours.get(t, ("",))[0] != "passed") \
        if args.side == "both" else []
    missing = [t for t in lost if not is_excluded(t)]
    table(files, theirs, ours, missing, [t for t in lost if is_excluded(t)])
    if args.list and missing:
        kinds = Counter()
        for t in missing:
            message = ours.get(t, ("", "not run on kvservice"))[1]
            kinds[category(message)] += 1
            print(f"  MISSING {t}: {summary(message)}")
        print("by kind of failure:")
        for kind, n in kinds.most_common():
            print(f"  {n:5d}  {kind}")
    if args.side != "both":
        return 0
    if missing:
        print(f"{len(missing)} tests pass on vLLM 0.33.0 but not on kvservice's schedulers (run with --list)")
        return 1
    print("every test that passes on vLLM 0.33.0 passes on kvservice's schedulers (exclusions aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
