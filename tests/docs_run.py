"""Runs the code blocks of the README and docs/ and compares what they print (tests/test_docs_run.py).

A fenced block is marked by an HTML comment on the line before it (invisible on GitHub and on the site):

    <!-- run -->               run it: ```python through this checkout's Python, a shell block line by line
    <!-- output -->            what the run block before it prints (`...` matches anything, as in doctest)
    <!-- not run: WHY -->      never run, and says why (every README block carries one of the three)

One page's blocks run in order in a fresh directory, against one fresh `kvservice serve` (its own data dir,
a free port) started where a shell block says `kvservice serve ...`: the address `127.0.0.1:50051` in the
blocks is replaced by the server's, and a `kvservice status|shards` line without `--target` gets it.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvservice.launch import ServeProcess, start_serve

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ADDRESS = "127.0.0.1:50051"
MARK = re.compile(r"^<!--\s*(run|output|not run:\s*(?P<why>.+?))\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+)(?P<info>.*)$")
SHELL = {"bash", "sh", "shell", "console", ""}
RUN_TIMEOUT_S = 180


@dataclass(slots=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: str | None  # "run", "output", "not run" or None
    why: str = ""
    expected: str | None = None  # for a run block: its output block's text

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the marker on the line before it."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m["fence"], i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.match(prev)
        indent = len(m["indent"])
        code = "\n".join(line[indent:] for line in lines[start + 1:j])
        lang = m["info"].strip().split()[0].lower() if m["info"].strip() else ""
        kind = None if not mark else ("not run" if mark["why"] else mark[1])
        found.append(Block(path, start + 1, lang, code, kind, (mark["why"] or "") if mark else ""))
        i = j + 1
    return found


def runnable(path: Path) -> list[Block]:
    """The run blocks of a file, each with the output block that follows it (if any)."""
    out: list[Block] = []
    for b in blocks(path):
        if b.mark == "run":
            out.append(b)
        elif b.mark == "output":
            if not out or out[-1].expected is not None:
                raise AssertionError(f"{b.where}: an output block with no run block before it")
            out[-1].expected = b.code
    return out


def same_output(want: str, got: str) -> bool:
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip().splitlines()) + "\n"  # noqa: E731
    return doctest.OutputChecker().check_output(norm(want), norm(got), doctest.ELLIPSIS)


@dataclass(slots=True)
class PageRun:
    """One page's blocks: a fresh directory and at most one fresh server."""

    workdir: Path
    server: ServeProcess | None = None
    log: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        return env

    def address(self, text: str) -> str:
        return text.replace(DEFAULT_ADDRESS, self.server.target) if self.server else text

    def run(self, block: Block) -> str:
        """What the block printed (stdout); raises AssertionError naming the block when it fails."""
        if block.lang in ("python", "py"):
            return self.check(block, [sys.executable, "-c", self.address(block.code)])
        if block.lang in SHELL:
            return "".join(self.shell_line(block, line) for line in block.code.splitlines() if line.strip())
        raise AssertionError(f"{block.where}: cannot run a ```{block.lang} block")

    def shell_line(self, block: Block, line: str) -> str:
        words = shlex.split(self.address(line), comments=True)
        if not words:
            return ""
        if Path(words[0]).name != "kvservice":
            return self.check(block, ["bash", "-c", self.address(line)])
        cmd, args = words[1] if len(words) > 1 else "", words[1:]
        if cmd == "serve":
            if self.server is not None:
                raise AssertionError(f"{block.where}: a second `kvservice serve` on one page")
            self.server = start_serve([*args[1:], "--port", "0", "--data-dir", str(self.workdir / "kvservice-data")],
                                      cwd=self.workdir, env=self.env(), death_signal=signal.SIGKILL,
                                      log=self.workdir / "kvservice-serve.log")
            return ""
        if cmd in ("status", "shards") and "--target" not in args and self.server is not None:
            args = [*args, "--target", self.server.target]
        return self.check(block, [sys.executable, "-m", "kvservice.cli", *args])

    def check(self, block: Block, argv: list[str]) -> str:
        proc = subprocess.run(argv, cwd=self.workdir, env=self.env(), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise AssertionError(f"{block.where}: `{shlex.join(argv)[:200]}` exited {proc.returncode}\n"
                                 f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")
        return proc.stdout

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
