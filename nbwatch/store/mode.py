"""Which journal a run folder's store uses: WAL on a local disk, a rollback journal on a
shared or network filesystem.

SQLite's WAL mode keeps its index in shared memory (`nbwatch.db-shm`, mmap'ed), which
works only among processes of one host: "WAL does not work over a network filesystem".
A folder on NFS, Lustre, GPFS, CIFS/SMB, BeeGFS, Ceph or a FUSE mount (sshfs, ceph-fuse)
is therefore written in "network" mode: `journal_mode=DELETE` (a rollback journal that
exists only while a write commits), `synchronous=FULL`, short write transactions, and a
writer's liveness from a heartbeat file (`lock.Heartbeat`) instead of `flock`, which such
filesystems may lack (Lustre without `-o flock`).

The mode is chosen when a writer opens the folder, in this order:

1. `RunStore(mode=...)` ("local", "network" or "auto");
2. the environment variable `NBWATCH_STORE_MODE` (the same values);
3. auto: the folder's filesystem type from `/proc/self/mountinfo` (Linux), then a probe in
   the folder: an `fcntl` lock and a shared `mmap` of a small file (what WAL needs); a
   network type or a failed probe gives "network", anything else (and any platform
   without `/proc`) "local".

The choice and its reason are stored in the run's meta (`store_mode`, `store_mode_why`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

LOCAL = "local"
NETWORK = "network"
MODES = (LOCAL, NETWORK)
ENV = "NBWATCH_STORE_MODE"

# filesystem types (mountinfo's field after " - ") on which several hosts share the files
NETWORK_FS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs",
    "afs", "ocfs2", "gfs2", "9p", "pvfs2", "orangefs", "wekafs", "panfs", "davfs",
})
LOCAL_FUSE = frozenset({"fuseblk", "fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse"})


def is_network_type(fstype: str) -> bool:
    """True for a filesystem type whose files other hosts may open (FUSE ones included:
    sshfs, ceph-fuse, s3fs; `fuseblk`, a local disk through FUSE, is not)."""
    t = fstype.lower()
    if t in LOCAL_FUSE:
        return False
    return t in NETWORK_FS or t.startswith(("fuse.", "nfs")) or t == "fuse"


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def mount_of(path: str | os.PathLike, mountinfo: str) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount that holds `path` (an absolute, resolved
    path), from the text of a `/proc/self/mountinfo`; None when no line covers it."""
    best: tuple[str, str] | None = None
    target = str(path)
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):  # later lines overmount
            best = (point, tail[0])
    return best


def fs_type(path: str | os.PathLike) -> str | None:
    """The filesystem type of the mount that holds `path` (its nearest existing folder),
    or None where the platform does not say (no `/proc/self/mountinfo`)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    found = mount_of(p.resolve(), text)
    return found[1] if found else None


def probe(folder: Path) -> str | None:
    """Try, in `folder`, what WAL and the writer lock need: an `fcntl` lock and a shared
    `mmap` of a small file. None when both work, else what failed."""
    path = folder / f".nbwatch-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as e:
        return f"a probe file could not be created in {folder} ({e})"
    try:
        os.write(fd, b"\0" * 4096)
        try:
            import fcntl
        except ImportError:  # not POSIX: SQLite uses its own locking there
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.lockf(fd, fcntl.LOCK_UN)
        except OSError as e:
            return f"fcntl locks fail there ({e})"
        try:
            with mmap.mmap(fd, 4096, mmap.MAP_SHARED) as m:
                m[:4] = b"wal?"
        except (OSError, ValueError) as e:
            return f"a shared mmap fails there ({e})"
        return None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()


def check_mode(value: str, where: str) -> str:
    v = value.strip().lower()
    if v not in (*MODES, "auto"):
        raise ValueError(f"{where}={value!r} is not a store mode: use 'local' (WAL, one "
                         "host), 'network' (rollback journal and a heartbeat, for NFS, Lustre,"
                         " GPFS and other shared filesystems) or 'auto' (from the folder's "
                         "filesystem)")
    return v


def choose(run_dir: str | os.PathLike, mode: str | None = None) -> tuple[str, str]:
    """(mode, why) for a writer of `run_dir` (which exists): see the module's text."""
    if mode is not None:
        mode = check_mode(mode, "RunStore(mode)")
        if mode != "auto":
            return mode, f"forced by RunStore(mode={mode!r})"
    env = os.environ.get(ENV, "")
    if env.strip():
        v = check_mode(env, ENV)
        if v != "auto":
            return v, f"forced by {ENV}={v}"
    folder = Path(run_dir)
    fstype = fs_type(folder)
    if fstype is not None and is_network_type(fstype):
        return NETWORK, (f"the folder is on a {fstype} filesystem, which other hosts share: "
                         "WAL needs shared memory on one host")
    failed = probe(folder)
    if failed is not None:
        return NETWORK, f"{failed}: WAL needs both"
    return LOCAL, f"the folder is on a local {fstype or 'disk'} filesystem"
