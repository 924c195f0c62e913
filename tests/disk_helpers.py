"""A small disk that fills up: a tmpfs of a given size, mounted for a test (as root, where mount works); and
one that fills at a chosen write step (`small_disk`): a ballast file takes all its space but a few pages, so
the next allocations past those fail with the disk's own ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(slots=True)
class Ballast:
    """A file on the tmpfs `fs` that takes its free space. `synced` is the filesystem the test writes to,
    synced before the ballast goes in (it differs from `fs` when that is a loop-mounted image on it)."""

    fs: Path
    synced: Path

    @property
    def path(self) -> Path:
        return self.fs / "ballast"

    def fill(self, free_pages: int = 0) -> None:
        """All the tmpfs's space but `free_pages` of its pages (4 KiB each, its unit of allocation)."""
        subprocess.run(["sync", "-f", str(self.synced)], check=True)
        unit = os.statvfs(self.fs).f_bsize
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                os.write(fd, b"\xa5" * unit)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        size = self.path.stat().st_size
        assert size >= free_pages * unit, f"the ballast ({size} bytes) cannot give back {free_pages} pages"
        os.truncate(self.path, size - free_pages * unit)

    def clear(self) -> None:
        """The space back."""
        self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def small_disk(mount: Path, size: int = 256 << 10, *, writeback: bool = False) -> Iterator[tuple[Path, Ballast]]:
    """A directory on a filesystem that runs out of space when its `Ballast` says so. Plain: a tmpfs of
    `size` bytes, where a write fails as it allocates. `writeback`: an ext4 image on a loop device, sparse
    on such a tmpfs and much larger than it, so ext4 takes every write into the page cache and the tmpfs
    under it fails the writeback, which `fsync` reports (ENOSPC): what a thin-provisioned or network disk
    does. Skips the test, saying why, where either cannot be set up."""
    if not writeback:
        with tiny_tmpfs(mount, size) as path:
            yield path, Ballast(path, path)
        return
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("no mkfs.ext4 here: an ext4 image that fails at fsync cannot be made")
    backing = mount.parent / f"{mount.name}-backing"
    with tiny_tmpfs(backing, size):
        image = backing / "ext4.img"
        with open(image, "wb") as f:
            f.truncate(64 << 20)
        # No journal and tiny inode tables, zeroed now (not by ext4's lazy-init thread while the ballast is in):
        # ext4 writes nothing to the image on its own; errors=continue keeps it writable after a failed writeback.
        made = subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-N", "128", "-O", "^has_journal",
                               "-E", "lazy_itable_init=0,nodiscard", str(image)], capture_output=True)
        mount.mkdir(exist_ok=True)
        done = made.returncode == 0 and subprocess.run(
            ["mount", "-o", "loop,errors=continue,noatime,noinit_itable", str(image), str(mount)],
            capture_output=True).returncode == 0
        if not done:
            pytest.skip(f"cannot loop-mount an ext4 image here ({made.stderr.decode().strip()[:100]})")
        try:
            yield mount, Ballast(backing, mount)
        finally:
            subprocess.run(["umount", str(mount)], check=False)  # and the loop device (autoclear)
