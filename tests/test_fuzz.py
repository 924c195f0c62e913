"""Coverage-guided fuzzing of request decoding and validation (tests/fuzz_targets.py): the committed seeds
and every crash ever found replay cleanly, a short deterministic fuzz run finds nothing, and the harness
does catch a planted bug. `make soak` runs the fuzzer for two minutes."""

import logging
import re
import subprocess
import sys

import pytest

from kvservice.allocator.requests import RequestBook
from kvservice.errors import InvalidArgument
from tests import fuzz_targets
from tests.fuzz.crashes import CrashLog
from tests.fuzz.run_fuzz import REGRESSIONS_DIR, REPO, SEEDS_DIR, fuzz_builtin

CASES = sorted(p for d in (SEEDS_DIR, REGRESSIONS_DIR) for p in d.iterdir()
               if p.is_file() and not p.name.startswith("."))


@pytest.fixture(autouse=True)
def quiet(caplog):
    """Epoch changes and refused resets log warnings on purpose; thousands of them slow the run."""
    caplog.set_level(logging.ERROR, logger="kvservice")


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_replay_seeds_and_regressions(path):
    fuzz_targets.replay(fuzz_targets.decode_file(path.read_bytes()))


def test_seeds_are_valid_requests():
    """Fuzzing starts from requests the service accepts."""
    for name, data in fuzz_targets.seed_inputs().items():
        fuzz_targets.replay([data])
        assert fuzz_targets.last_outcome() == "OK", name


def test_sequence_files_round_trip():
    inputs = [b"\x00\x00\x00\x00", b"", b"\x02abc"]
    assert fuzz_targets.decode_file(fuzz_targets.encode_sequence(inputs)) == inputs
    assert fuzz_targets.decode_file(b"\x01\x02") == [b"\x01\x02"]


def test_harness_catches_planted_bugs(monkeypatch, tmp_path):
    seeds = fuzz_targets.seed_inputs()
    original = RequestBook.free_op

    def crashing(self, pool, session, op):
        if op.request_id == "r1":
            raise KeyError(op.request_id)
        return original(self, pool, session, op)

    monkeypatch.setattr(RequestBook, "free_op", crashing)
    with pytest.raises(fuzz_targets.FuzzCrash, match="KeyError"):
        fuzz_targets.replay([seeds["free"]])
    with pytest.raises(fuzz_targets.FuzzCrash) as info:
        fuzz_targets.replay([seeds["heartbeat"], seeds["free"]])
    crash = CrashLog(tmp_path, log=lambda _: None).record(seeds["free"], info.value, fuzz_targets.history())
    assert crash.inputs == [crash.inputs[-1]] and len(crash.inputs[-1]) <= len(seeds["free"])
    assert crash.path.read_bytes() == crash.inputs[0]  # minimized, reproducible alone

    def half_applied(self, pool, session, op):
        original(self, pool, session, op)
        raise InvalidArgument("request_ids", op.request_id, "planted")

    monkeypatch.setattr(RequestBook, "free_op", half_applied)
    with pytest.raises(fuzz_targets.FuzzCrash, match="changed the state"):
        fuzz_targets.replay([seeds["free"]])


def test_short_fuzz_run(tmp_path):
    """Deterministic (seed 0) unless the time bound cuts it short on a slow machine."""
    lines = []
    summary = fuzz_builtin(20.0, None, tmp_path / "crashes", seed=0, max_execs=1500, log=lines.append)
    assert not summary.crashes, "\n".join(c.report for c in summary.crashes)
    assert summary.execs >= 300, summary.line()
    assert summary.outcomes.get("OK", 0) >= summary.execs // 20, summary.outcomes  # mutations really apply
    assert summary.outcomes.get("INVALID_ARGUMENT", 0) > 0, summary.outcomes


@pytest.mark.soak
def test_fuzz_soak(tmp_path):
    """Two minutes of the fuzzer (atheris when installed), as `python tests/fuzz/run_fuzz.py` runs it."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "fuzz" / "run_fuzz.py"), "--seconds", "120",
                           "--corpus", str(tmp_path / "corpus"), "--crashes", str(tmp_path / "crashes")],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    summary = re.findall(r"^fuzz: \d+ execs in .*$", proc.stdout, re.M)
    assert proc.returncode == 0 and summary and summary[-1].endswith("crashes 0"), proc.stdout[-5000:]
