"""Preloaded by the fork server the ranks start from (``launch.PRELOAD``): the server ignores SIGTERM.

A scheduler preempts a job by sending SIGTERM to all of its processes, the fork server
included. The server must outlive that signal: it reports each rank's exit status to the
launcher, and a server killed first makes every rank look failed (exit 255) while they save.
Ranks, forked from it, restore the default at once (``as_rank``)."""
import signal
import sys

if sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def as_rank() -> None:
    """In a process forked from the server: take SIGTERM again (the default: end the process,
    unless the run installs its own handler, as the checkpoint saver does)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
