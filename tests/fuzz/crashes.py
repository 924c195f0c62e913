"""Crashes found by fuzzing: told apart by signature, reproduced from a fresh fixture (alone, else with the
calls since the last reset), minimized, and written as files `fuzz_targets.replay(decode_file(...))` re-runs."""

from __future__ import annotations

import hashlib
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.fuzz.mutate import message_class, message_fields, targets


@dataclass(slots=True)
class Crash:
    signature: str
    inputs: list[bytes]  # replayed in order from a fresh fixture
    report: str
    path: Path | None = None


def signature(exc: BaseException) -> str:
    """What a crash is, independent of the values: its message's words and where the cause was raised."""
    cause = exc.__cause__ or exc
    frames = traceback.extract_tb(cause.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "?"
    text = re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "_", str(exc).split("\n", 1)[0])[:120]
    return f"{type(cause).__name__} at {where}: {text}"


def _fails(inputs: list[bytes], sig: str) -> bool:
    fuzz = targets()
    try:
        fuzz.replay(inputs)
    except Exception as exc:
        return signature(exc) == sig
    return False


def _shrink_message(data: bytes, sig: str, prefix: list[bytes], budget: list[int]) -> bytes:
    """Greedy: drop repeated elements, clear fields, cut bytes, while the crash persists."""
    fuzz = targets()
    try:
        msg = message_class(fuzz.METHODS[data[0] % len(fuzz.METHODS)]).FromString(data[fuzz.HEADER:])
    except Exception:
        msg = None
    progress = True
    while msg is not None and progress and budget[0] > 0:
        progress = False
        pairs = message_fields(msg)
        for k in reversed(range(len(pairs))):  # leaves first; the walk order is the same in a copy
            owner, fd = pairs[k]
            if budget[0] <= 0:
                break
            if fd.is_repeated:
                if not len(getattr(owner, fd.name)):
                    continue
            elif fd.message_type is not None and not owner.HasField(fd.name):
                continue
            elif fd.message_type is None and fd.containing_oneof is None and not getattr(owner, fd.name):
                continue
            trial = type(msg)()
            trial.CopyFrom(msg)
            t_owner, t_fd = message_fields(trial)[k]
            if t_fd.is_repeated:
                del getattr(t_owner, t_fd.name)[-1]
            else:
                t_owner.ClearField(t_fd.name)
            candidate = data[:fuzz.HEADER] + trial.SerializeToString()
            budget[0] -= 1
            if _fails([*prefix, candidate], sig):
                msg, data, progress = trial, candidate, True
                break
    chunk = max(1, (len(data) - fuzz.HEADER) // 2)
    while chunk >= 1 and budget[0] > 0:
        at = fuzz.HEADER
        while at < len(data) and budget[0] > 0:
            candidate = data[:at] + data[at + chunk:]
            budget[0] -= 1
            if _fails([*prefix, candidate], sig):
                data = candidate
            else:
                at += chunk
        chunk //= 2
    return data


def minimize(inputs: list[bytes], sig: str, budget: int = 300) -> list[bytes]:
    """Drops the calls before the crash that it does not need, then shrinks the crashing call."""
    left = [budget]
    i = 0
    while i < len(inputs) - 1 and left[0] > 0:
        trial = inputs[:i] + inputs[i + 1:]
        left[0] -= 1
        if _fails(trial, sig):
            inputs = trial
        else:
            i += 1
    return [*inputs[:-1], _shrink_message(inputs[-1], sig, inputs[:-1], left)]


class CrashLog:
    """Distinct crashes (by signature), reproduced from a fresh fixture, minimized, written as files."""

    def __init__(self, directory: Path | None, log: Callable[[str], None] = print, max_files: int = 50) -> None:
        self.directory = directory
        self.log = log
        self.max_files = max_files
        self.crashes: dict[str, Crash] = {}
        self.total = 0

    def record(self, data: bytes, exc: BaseException, history: list[bytes]) -> Crash | None:
        fuzz = targets()
        self.total += 1
        sig = signature(exc)
        if sig in self.crashes:
            return None
        report = "".join(traceback.format_exception(exc))
        if _fails([data], sig):
            inputs = [data]
        elif _fails(history, sig):
            inputs = history
        else:
            inputs = history
            report += "\n(not reproduced from a fresh fixture: the file holds the calls since the last reset)\n"
        inputs = minimize(inputs, sig) if _fails(inputs, sig) else inputs
        crash = Crash(sig, inputs, report)
        self.crashes[sig] = crash
        if self.directory is not None and len(self.crashes) <= self.max_files:
            blob = inputs[0] if len(inputs) == 1 else fuzz.encode_sequence(inputs)
            self.directory.mkdir(parents=True, exist_ok=True)
            crash.path = self.directory / f"crash-{hashlib.sha1(sig.encode()).hexdigest()[:12]}"
            crash.path.write_bytes(blob)
        self.log(f"fuzz: CRASH {sig}\n  input: {crash.path or '(not written)'} ({len(inputs)} call(s))\n{report}")
        fuzz.reset()
        return crash
