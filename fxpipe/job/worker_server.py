"""The process ``fxpipe run``'s local workers fork from (multiprocessing's forkserver).

Spawned, each of N workers started a fresh interpreter and imported torch and fxpipe
(~5 s of CPU apiece); forked from a server that imported them once, a
worker starts with them loaded. This module is the server's first import, and only
the server's (``launcher.WORKER_SERVER_PRELOAD``): it sets a signal disposition.

The server ignores SIGTERM, as multiprocessing makes it ignore SIGINT. A signal sent
to the job's whole process group (Ctrl-C, ``kill -TERM -PGID``, a scheduler's stop)
reaches the workers, which save and stop after the same step, and the server, which
reports each worker's exit code to the launcher: dead, it would report every worker
gone at once and the launcher would return before their save. Each worker restores
SIGTERM's default as it starts (``launcher._spawned_entry``).
"""
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
