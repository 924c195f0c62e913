"""A small disk that fills up: a tmpfs of a given size, mounted for a test (as root, where mount works)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tiny_tmpfs(mount: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes at `mount` (made), unmounted afterwards; skips the test, saying why, where it
    cannot be mounted."""
    mount.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()[:100]})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
