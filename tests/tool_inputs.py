"""What the command-line tools in tests/ refuse before any work, as train_gpt.py refuses its own inputs: one line
`error: <sentence>` on stderr that names the flag, its value and what to do, exit status 2, no traceback.

Only the standard library here: importing torch and train_gpt takes seconds, and the tools that need neither for
their checks (gpu_session.py, benchmark_cpu.py) refuse before that.
"""
import errno
import os
import sys
from pathlib import Path


class FlagError(Exception):
    """A tool's flag it cannot use, in one sentence: train_gpt.UserError's kind, without importing train_gpt."""


def need(ok: bool, message: str) -> None:
    if not ok:
        raise FlagError(message)


def need_at_least(flag: str, value, least, what: str) -> None:
    """A count or a time in seconds: `what` says what the flag gives."""
    need(value >= least, f"{flag} {value}: give at least {least} ({what})")


def need_files(flag: str, folder: Path, names: tuple[str, ...], what: str) -> None:
    """The folder a flag names holds each of these files."""
    absent = [name for name in names if not (Path(folder) / name).is_file()]
    need(not absent, f"{flag} {folder} lacks {what} ({', '.join(absent)} missing): name the folder that holds it")


def need_out_folder(flag: str, folder: Path) -> None:
    """An output folder the tool may make and write into: not a file, under no file, not a symbolic link (a tool
    writes only into folders of its own, never through a link), and one it can write into (made, and tried)."""
    folder = Path(folder)
    if folder.is_symlink():
        raise FlagError(f"{flag} {folder} is a symbolic link (to {os.readlink(folder)}): a tool writes into folders of "
                        "its own, never through a link; name the folder it links to, or another")
    need(not folder.exists() or folder.is_dir(), f"{flag} {folder} is a file: name a folder")
    above = next((parent for parent in folder.parents if parent.exists() and not parent.is_dir()), None)
    need(above is None, f"{flag} {folder} lies under {above}, which is a file: name a folder elsewhere")
    links = sorted(path for path in folder.iterdir() if path.is_symlink()) if folder.is_dir() else []
    named = ", ".join(f"{link.name} (to {os.readlink(link)})" for link in links[:3])
    need(not links, f"{flag} {folder} holds {len(links)} symbolic link(s): {named}: the tool writes its files there, "
         "never through a link; remove the links, or name another folder")
    try:  # (made now, and written to once: a report lost after the work, on a read-only disk, is the work lost)
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_check_{os.getpid()}"
        with open(probe, "x"):
            pass
        probe.unlink()
    except OSError as e:
        raise FlagError(f"{flag} {folder}: the tool cannot write there ({e.strerror}): name a folder it may write "
                        "into") from None


def open_own(path: Path, mode: str = "w"):
    """A file the tool writes into its output folder, truncated, opened so that a link standing at its name (one made
    since need_out_folder looked) is refused by name, never followed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise FlagError(f"{path} is a symbolic link (to {os.readlink(path)}): the tool writes only files of its own, "
                        "never through a link; remove it") from None
    return open(fd, mode)


def run_tool(main, *errors: type[Exception]) -> None:
    """sys.exit(main()); a FlagError, or one of `errors` (train_gpt.UserError in the tools that import train_gpt),
    becomes one `error:` line with exit status 2."""
    try:
        sys.exit(main())
    except (FlagError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
