"""The agents' journal: durable events and snapshots in SQLite, and recovery plans.

``Executor(journal=PATH)`` keeps, in directory PATH:

* ``journal.db``: what the journal is (format, stealer version, owner), one row per
  executor that opened it (its *epoch*), and the handles the recovering executor gave its
  agents (workers read them to remap refs).
* ``client.db`` and ``w<k>.db``: the *shards*, one per writer process (the client, worker
  k), each in WAL mode with a single writer, so a slow disk stalls one shard, not every
  agent: spawns, messages (written before they are pushed), snapshots, replies, ends.

The modules, along the journal's seams:

* store.py: the writer of a shard (:class:`Shard`: its rows, their checksums, the
  durability modes), ``journal.db`` (:class:`ControlDB`) and its metadata check;
* opening.py: the directory's checks and locks, and each process's handle on the
  journal: :func:`open_for_client` / :class:`ClientJournal` (the client) and
  :class:`WorkerJournal` (a worker);
* plan.py: the recovery plan (:func:`plan`): per agent, the snapshot it restores and the
  messages it replays, damaged rows cut;
* inspection.py: what ``stealer journal PATH`` prints (:func:`describe`).

The blobs and keys every side shares without SQLite are in stealer/agents/jblob.py
(re-exported here).  Who calls it: stealer/client/executor.py opens the journal
(``open_for_client``), stealer/client/agents.py writes the client's events and replays a
plan, stealer/worker/loop.py opens a worker's side (``WorkerJournal``) that the agents'
host in stealer/worker/agents/ writes, stealer/cli.py shows it.  No module of the client
or worker side imports this package unless a journal is used.

Without a recovery, a worker death restarts its agents from their in-memory checkpoints,
and a caller may call again a call whose reply it had already received.  So a callee keeps
each reply to an agent's call until the caller acknowledges it: every journaled message
carries ``ack``, the sender's sequence number when its latest checkpoint was taken, and
the callee forgets that sender's replies up to it.  The kept replies are part of the
callee's checkpoint (and snapshot), so they survive its own restart.
"""

from stealer.agents.jblob import loads, pack, sender_is_agent, unpack
from stealer.agents.journal.inspection import agent_log, describe
from stealer.agents.journal.opening import MODES, ClientJournal, WorkerJournal, open_for_client
from stealer.agents.journal.plan import AgentPlan, Plan, plan
from stealer.agents.journal.store import CONTROL, FORMAT, SYNC_EVERY, ControlDB, Shard

__all__ = ["FORMAT", "MODES", "CONTROL", "SYNC_EVERY", "Shard", "ControlDB",
           "open_for_client", "ClientJournal", "WorkerJournal", "plan", "Plan", "AgentPlan",
           "describe", "agent_log", "pack", "unpack", "loads", "sender_is_agent"]
