"""Imported only by the fork server the ranks start from (``launch.PRELOAD``): it ignores SIGTERM.

A scheduler preempts a job by sending SIGTERM to all of its processes, the fork server
included. The server must outlive that signal: it reports each rank's exit status to the
launcher, and a server killed first makes every rank look failed (exit 255) while they save.
Ranks, forked from it, restore the default at once (``launch._in_launcher_env``)."""
import signal
import sys

if sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
