"""The agents' journal (a package; the module journal.py moved to journal/store.py)."""

from stealer.agents.journal.store import *  # noqa: F403
from stealer.agents.journal.store import (  # noqa: F401 (what importers use beyond __all__)
    CONTROL,
    SYNC_EVERY,
    ClientJournal,
    WorkerJournal,
    describe,
    loads,
    os,
)
