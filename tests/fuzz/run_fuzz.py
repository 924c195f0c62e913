"""Bounded-time coverage-guided fuzzing of request decoding and validation (target: tests/fuzz_targets.py).

    python tests/fuzz/run_fuzz.py --seconds 60 [--corpus DIR] [--crashes DIR] [--engine auto|atheris|builtin]
    python tests/fuzz/run_fuzz.py --engine builtin --seconds 0 --corpus DIR --coverage   # a corpus's coverage

Engines: `atheris` (libFuzzer over bytecode-instrumented `kvservice`; calls run one after another on the
target's shared allocator) when it is installed; otherwise `builtin`, a small loop of our own whose corpus
entries are short call sequences, each run from a fresh fixture (so a run is repeatable for a seed), kept
when they reach new line arcs of `kvservice` (`sys.settrace`). Both mutate with `tests.fuzz.mutate`
(mostly protobuf-aware; atheris mixes in libFuzzer's byte mutations). The corpus starts from the valid
requests of `fuzz_targets.seed_inputs()`, the committed seeds and the regressions. Crashes go through
`tests.fuzz.crashes` (reproduced, minimized, written to --crashes). Exit status 1 when any was found.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.fuzz.crashes import Crash, CrashLog  # noqa: E402 - after the path fix; imports no kvservice
from tests.fuzz.mutate import MAX_INPUT, mutate, targets  # noqa: E402

FUZZ_DIR = Path(__file__).resolve().parent
SEEDS_DIR = FUZZ_DIR / "seeds"
REGRESSIONS_DIR = FUZZ_DIR / "regressions"
# Not traced by the builtin engine: the harness's own checks (digest, invariants) run on every call and
# their coverage follows the state, not the input.
UNTRACED = ("store/snapshot.py", "core/invariants.py", "core/state.py")
ENGINES = ("auto", "atheris", "builtin")
MAX_CALLS = 8  # per builtin corpus entry


# ---- corpus --------------------------------------------------------------------------------------
def initial_corpus(corpus_dir: Path | None) -> list[list[bytes]]:
    """Generated seeds, the committed seeds and regressions, and what the corpus directory holds (each a
    list of calls run in order from a fresh fixture)."""
    fuzz = targets()
    found: dict[tuple[bytes, ...], None] = {}
    for data in fuzz.seed_inputs().values():
        found[(data,)] = None
    for directory in (SEEDS_DIR, REGRESSIONS_DIR, corpus_dir):
        if directory is not None and directory.is_dir():
            for path in sorted(directory.iterdir()):
                if path.is_file() and not path.name.startswith("."):
                    found[tuple(fuzz.decode_file(path.read_bytes()))] = None
    if corpus_dir is not None:
        corpus_dir.mkdir(parents=True, exist_ok=True)
        for calls in found:
            save_input(corpus_dir, list(calls))
    return [list(calls) for calls in found if calls]


def save_input(directory: Path, calls: list[bytes]) -> None:
    data = calls[0] if len(calls) == 1 else targets().encode_sequence(calls)
    path = directory / hashlib.sha1(data).hexdigest()
    if not path.exists():
        path.write_bytes(data)


# ---- builtin engine ------------------------------------------------------------------------------
@dataclass(slots=True)
class Summary:
    engine: str
    execs: int = 0
    seconds: float = 0.0
    corpus: int = 0
    coverage: int = 0  # distinct line arcs in kvservice (builtin), or libFuzzer's own count (atheris)
    crashes: list[Crash] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        return f"fuzz: {self.execs} execs in {self.seconds:.1f} s, corpus {self.corpus}, crashes {len(self.crashes)}"


class ArcTracer:
    """Line arcs (code, previous line, line) executed in `kvservice`, through sys.settrace."""

    def __init__(self) -> None:
        import kvservice
        self.root = str(Path(kvservice.__file__).resolve().parent) + os.sep
        self.arcs: set[tuple[object, int, int]] = set()
        self._files: dict[str, bool] = {}
        self._last = 0

    def _wanted(self, filename: str) -> bool:
        wanted = self._files.get(filename)
        if wanted is None:
            wanted = filename.startswith(self.root) and not filename.endswith(UNTRACED)
            self._files[filename] = wanted
        return wanted

    def global_trace(self, frame, event, arg):
        if event != "call" or not self._wanted(frame.f_code.co_filename):
            return None
        code = frame.f_code
        last = [-1]
        arcs = self.arcs

        def local(frame, event, arg):
            if event == "line":
                line = frame.f_lineno
                arcs.add((code, last[0], line))
                last[0] = line
            return local
        return local

    def run(self, fn: Callable[[], None]) -> int:
        """Runs fn traced; returns how many new arcs it reached (exceptions propagate)."""
        before = len(self.arcs)
        previous = sys.gettrace()
        sys.settrace(self.global_trace)
        try:
            fn()
        finally:
            sys.settrace(previous)
        return len(self.arcs) - before


def mutate_sequence(calls: list[bytes], rng: random.Random, corpus: list[list[bytes]]) -> list[bytes]:
    """1-3 of: mutate a call, insert a call from another entry, drop a call, splice two entries. Stacked,
    because a state-dependent bug needs an odd call and the call that trips on it in one step."""
    calls = list(calls)
    for _ in range(rng.choice((1, 1, 2, 3))):
        roll = rng.random()
        donor = rng.choice(corpus)
        if roll < 0.55 or len(calls) >= MAX_CALLS:
            i = len(calls) - 1 if rng.random() < 0.5 else rng.randrange(len(calls))
            calls[i] = mutate(calls[i], rng, rng.choice(corpus))
        elif roll < 0.85:
            calls.insert(rng.randint(0, len(calls)), rng.choice(donor))
        elif roll < 0.93 and len(calls) > 1:
            del calls[rng.randrange(len(calls))]
        else:
            calls = calls[:rng.randint(1, len(calls))] + donor[rng.randrange(len(donor)):]
        calls = calls[:MAX_CALLS]
    return calls


def fuzz_builtin(seconds: float, corpus_dir: Path | None = None, crashes_dir: Path | None = None, seed: int = 0,
                 max_execs: int | None = None, log: Callable[[str], None] = print,
                 progress_every_s: float = 10.0) -> Summary:
    """The builtin engine. Its corpus entries are short call sequences, each run from a fresh fixture, so
    the run is deterministic for a given seed and exec count (execs count calls)."""
    fuzz = targets()
    rng = random.Random(seed)
    start = time.monotonic()
    deadline = start + seconds
    tracer = ArcTracer()
    crashes = CrashLog(crashes_dir, log)
    summary = Summary("builtin")
    corpus: list[list[bytes]] = []

    def execute(calls: list[bytes]) -> bool:
        fuzz.reset()
        done = 0

        def run() -> None:
            nonlocal done
            for data in calls:
                done += 1
                fuzz.run_one(data)
                outcome = fuzz.last_outcome() or "short"
                summary.outcomes[outcome] = summary.outcomes.get(outcome, 0) + 1

        try:
            new = tracer.run(run)
        except Exception as exc:
            crash = crashes.record(calls[done - 1], exc, fuzz.history())
            if crash is not None:
                summary.crashes.append(crash)
            return False
        finally:
            summary.execs += done
        return new > 0

    for calls in initial_corpus(corpus_dir):
        execute(calls)
        corpus.append(calls)
    next_report = start + progress_every_s
    while time.monotonic() < deadline and (max_execs is None or summary.execs < max_execs):
        # Newer entries (fresh coverage) are picked more often, the rest uniformly.
        i = len(corpus) - 1 - min(int(rng.expovariate(0.1)), len(corpus) - 1) if rng.random() < 0.5 else \
            rng.randrange(len(corpus))
        calls = mutate_sequence(corpus[i], rng, corpus)
        if execute(calls):
            corpus.append(calls)
            if corpus_dir is not None:
                save_input(corpus_dir, calls)
        now = time.monotonic()
        if now >= next_report:
            log(f"fuzz: {summary.execs} execs, {summary.execs / (now - start):.0f}/s, corpus {len(corpus)}, "
                f"arcs {len(tracer.arcs)}, crashes {len(summary.crashes)}, outcomes {summary.outcomes}")
            next_report = now + progress_every_s
    summary.seconds = time.monotonic() - start
    summary.corpus = len(corpus)
    summary.coverage = len(tracer.arcs)
    return summary


def line_coverage(sequences: list[list[bytes]],
                  files: tuple[str, ...] = ("wire.py", "server/servicer.py", "allocator.py")):
    """Per file: (lines executed, lines in functions) when the call sequences run, each from a fresh fixture."""
    fuzz = targets()
    tracer = ArcTracer()
    for calls in sequences:
        try:
            fuzz.reset()
            tracer.run(lambda: [fuzz.run_one(data) for data in calls])  # noqa: B023 - run now
        except Exception:
            pass
    out = {}
    for name in files:
        path = Path(tracer.root) / name
        source = path.read_text().splitlines()
        executable, stack = set(), [compile("\n".join(source), str(path), "exec")]
        while stack:  # the lines of function bodies (module and class bodies run at import)
            c = stack.pop()
            if c.co_flags & inspect.CO_OPTIMIZED:
                executable.update(line for _, _, line in c.co_lines() if line is not None
                                  and not source[line - 1].lstrip().startswith(("def ", "async def ", "@")))
            stack.extend(k for k in c.co_consts if hasattr(k, "co_lines"))
        hit = {line for c, _, line in tracer.arcs if c.co_filename == str(path)}
        out[name] = (len(hit & executable), len(executable))
    return out


# ---- atheris engine ------------------------------------------------------------------------------
def fuzz_atheris(seconds: float, corpus_dir: Path, crashes_dir: Path | None, seed: int,
                 max_execs: int | None) -> None:
    """libFuzzer through atheris; exits the process (libFuzzer owns the loop) after the summary line."""
    import atheris

    with atheris.instrument_imports(include=["kvservice"]):
        import kvservice.allocator  # noqa: F401 - instrumented here, used through the target
        import kvservice.server.servicer  # noqa: F401
        import kvservice.wire  # noqa: F401
    fuzz = targets()
    logging.getLogger("kvservice").setLevel(logging.ERROR)
    seeds = [data for calls in initial_corpus(corpus_dir) for data in calls]
    crashes = CrashLog(crashes_dir)
    summary = Summary("atheris")
    start = time.monotonic()
    deadline = start + seconds
    state = {"next_report": start + 10.0}

    def finish() -> None:
        summary.seconds = time.monotonic() - start
        summary.corpus = sum(1 for p in corpus_dir.iterdir() if p.is_file())
        print(summary.line(), flush=True)
        os._exit(1 if summary.crashes else 0)

    def test_one_input(data: bytes) -> None:
        now = time.monotonic()
        if now >= deadline or (max_execs is not None and summary.execs >= max_execs):
            finish()
        summary.execs += 1
        try:
            fuzz.run_one(data)
        except Exception as exc:
            crash = crashes.record(data, exc, fuzz.history())
            if crash is not None:
                summary.crashes.append(crash)
        if now >= state["next_report"]:
            print(f"fuzz: {summary.execs} execs, {summary.execs / (now - start):.0f}/s, crashes "
                  f"{len(summary.crashes)} (libFuzzer's cov/corp on the lines above)", flush=True)
            state["next_report"] = now + 10.0

    def custom_mutator(data: bytes, max_size: int, mutator_seed: int) -> bytes:
        rng = random.Random(mutator_seed)
        if rng.random() < 0.4:
            return atheris.Mutate(data, max_size)
        return mutate(data, rng, seeds)[:max_size]

    argv = [sys.argv[0], str(corpus_dir), f"-seed={seed or 1}", f"-max_total_time={int(seconds) + 30}",
            f"-max_len={MAX_INPUT}", "-print_final_stats=1"]
    atheris.Setup(argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()
    finish()


def atheris_available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="time bound (default 60)")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="corpus directory: seeded with valid requests, grows with new coverage (default: a "
                             "fresh temporary directory)")
    parser.add_argument("--crashes", type=Path, default=Path("fuzz-crashes"), help="where crashing inputs go")
    parser.add_argument("--engine", choices=ENGINES, default="auto", help="atheris when installed (auto)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (builtin: the whole run is repeatable)")
    parser.add_argument("--max-execs", type=int, default=None, help="stop after this many executions")
    parser.add_argument("--coverage", action="store_true",
                        help="after the run, replay the corpus and print line coverage of wire/servicer/allocator")
    parser.add_argument("--write-seeds", type=Path, default=None, metavar="DIR",
                        help="write the generated seed inputs (valid requests) to DIR and exit")
    args = parser.parse_args(argv)
    if args.write_seeds is not None:
        args.write_seeds.mkdir(parents=True, exist_ok=True)
        for name, data in targets().seed_inputs().items():
            (args.write_seeds / name).write_bytes(data)
        return 0
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if atheris_available() else "builtin"
    if args.corpus is None:
        args.corpus = Path(tempfile.mkdtemp(prefix="kvfuzz-corpus-"))
    print(f"fuzz: engine {engine}, {args.seconds:.0f} s, corpus {args.corpus}, crashes -> {args.crashes}",
          flush=True)
    if engine == "atheris":
        fuzz_atheris(args.seconds, args.corpus, args.crashes, args.seed, args.max_execs)
        return 0  # not reached: libFuzzer exits the process
    logging.getLogger("kvservice").setLevel(logging.ERROR)
    summary = fuzz_builtin(args.seconds, args.corpus, args.crashes, args.seed, args.max_execs)
    print(f"fuzz: outcomes {summary.outcomes}, {summary.coverage} arcs in kvservice")
    if args.coverage:
        sequences = [targets().decode_file(p.read_bytes()) for p in sorted(args.corpus.iterdir())]
        for name, (hit, total) in line_coverage(sequences).items():
            print(f"fuzz: coverage {name}: {hit}/{total} lines ({100 * hit / total:.0f}%)")
    print(summary.line(), flush=True)
    return 1 if summary.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
