"""Files that a kill cannot leave half-written, and a record to check kept files against.

:func:`write_atomically` and :func:`copy_atomically` write to a temporary name
beside the destination (``.NAME.PID.tmp``), flush it to disk and rename it: the
destination is whole or absent, never partial.  Temporary files a killed run
left are removed by :func:`remove_stale_temporaries`.

:class:`FileManifest` records, per file a run wrote into a directory, its size,
its SHA-256 and where it came from, so that a later run trusts a file it keeps
only after checking it (:meth:`FileManifest.problem`).

:func:`cached_build` builds a directory once per content key under ``$FASTGEN_CACHE``
(default ``~/.cache/fairseq_fastgen``): fastgen-bench's CTranslate2 conversions, the
demo's and the tests' toy models.

For tests, ``FASTGEN_KILL_AT_WRITE_STEP=N`` kills the process (SIGKILL, as
``kill -9`` would) at its N-th write step: after a temporary file is written and
before it is renamed, and after it is renamed.  With the variable set, every step
is printed on stderr (``write step N: ...``), so a test can list them.
"""

import fcntl
import hashlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Optional

KILL_AT_WRITE_STEP_ENV = "FASTGEN_KILL_AT_WRITE_STEP"
TEMPORARY_SUFFIX = ".tmp"
HASH_CHUNK_BYTES = 1 << 20

_steps_taken = 0


def write_step(what: str):
    """A point where a kill leaves a temporary file, or a file renamed but not yet recorded (test hook)."""
    global _steps_taken
    kill_at = os.environ.get(KILL_AT_WRITE_STEP_ENV)
    if kill_at is None:
        return
    _steps_taken += 1
    print(f"write step {_steps_taken}: {what}", file=sys.stderr, flush=True)
    if _steps_taken == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)


def temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{TEMPORARY_SUFFIX}")


def write_atomically(path: Path, write):
    """``write(file)`` into a temporary file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    tmp = temporary_path(path)
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    write_step(f"{path.name} written to its temporary file")
    os.replace(tmp, path)
    write_step(f"{path.name} renamed")


def check_writable(option: str, path):
    """Refuse, in one line naming ``option`` (a ``ValueError``), a file that a run writes at its end
    (:func:`write_atomically`) but could not write: checked before the run does its work, by writing and removing
    the temporary file that will be written beside it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file to write")
    tmp = temporary_path(path)
    try:
        open(tmp, "wb").close()
    except OSError as error:
        raise ValueError(f"{option} {path} cannot be written: {error.strerror} ({tmp.parent})") from error
    tmp.unlink()


def copy_atomically(source: Path, destination: Path):
    def copy(f):
        with open(source, "rb") as original:
            shutil.copyfileobj(original, f)

    write_atomically(destination, copy)


def remove_stale_temporaries(directory: Path):
    """Remove the temporary files that a killed run left in ``directory``: ``.NAME.PID.tmp`` of
    :func:`write_atomically`, and ``.NAME.PID.tmp.EXT`` of writers that add their own extension."""
    for pattern in (f".*{TEMPORARY_SUFFIX}", f".*{TEMPORARY_SUFFIX}.*"):
        for stale in Path(directory).glob(pattern):
            stale.unlink()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


class FileManifest:
    """``DIRECTORY/NAME``: per file written into DIRECTORY, its size, SHA-256 and origin (free text, e.g.
    ``copy`` or ``distilled``).  Rewritten atomically after each change."""

    def __init__(self, directory: Path, name: str):
        self.path = Path(directory) / name
        self.entries = {}
        if self.path.exists():
            try:
                self.entries = json.loads(self.path.read_text())
            except ValueError as error:
                raise ValueError(f"{self.path} is damaged ({error}); delete it to check every file again") from error

    def origin(self, path: Path) -> Optional[str]:
        entry = self.entries.get(Path(path).name)
        return entry["origin"] if entry else None

    def record(self, path: Path, origin: str):
        path = Path(path)
        self.entries[path.name] = {"bytes": path.stat().st_size, "sha256": sha256(path), "origin": origin}
        write_atomically(self.path, lambda f: f.write(json.dumps(self.entries, indent=2, sort_keys=True).encode()))

    def problem(self, path: Path) -> Optional[str]:
        """None when ``path`` is what was recorded; else what is wrong with it."""
        path = Path(path)
        entry = self.entries.get(path.name)
        if entry is None:
            return "not recorded as written by this tool"
        if not path.exists():
            return "missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{size} bytes where {entry['bytes']} were written"
        if sha256(path) != entry["sha256"]:
            return "its content changed since it was written (SHA-256 differs)"
        return None


def cache_root() -> Path:
    return Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fairseq_fastgen"))


def cached_build(name, key_parts, build):
    """Build an artifact directory once per content key, shared across processes.

    ``build(tmp_dir)`` fills a fresh directory; it is renamed into place only
    when complete, and a file lock makes concurrent callers (pytest-xdist
    workers) wait for the first builder instead of building twice.
    """
    digest = hashlib.sha256("\x00".join(str(p) for p in key_parts).encode()).hexdigest()[:16]
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{digest}"
    with open(root / f"{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not final.exists():
            tmp = root / f"{name}-{digest}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            build(tmp)
            tmp.rename(final)
    return final
