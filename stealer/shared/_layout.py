"""The one source of truth for the task-record layout and its state codes.

Plain integer assignments only (``NAME = <int>``, comments allowed): setup.py
reads this file without importing the package and writes
``native/_layout.pxi`` from it, which ``native/_cqueues.pxd`` includes, so
the Cython hot path and the Python side can never disagree.  A test checks
that the compiled module's ``LAYOUT`` equals this file.

A record (RECORD_BYTES) describes one task; see stealer/shared/records.py for the
lifecycle and stealer/shared/arena.py for payload storage.  Imported by every module that
reads or writes a record, a directory entry or a result status, on both sides (the shared
structures, the client, the worker, the agents) and by stealer/errors.py.
"""

# -- record fields (byte offsets) ---------------------------------------------
R_WORD0 = 0  # u64 gen (bits 0-31) | state (32-39) | who (40-63): every transition is a CAS on it
R_KIND = 8  # u32 K_* | F_* flags: the record's producer, before the queue push
R_STATUS = 12  # u32 ST_* of the result: the worker (or recoverer) that stores it, before DONE
R_LINK = 16  # u64 future id (root) or parent handle (child): the producer, before the push
R_TRIES = 24  # u32 runs started so far minus one: bumped by whoever re-queues after a death
R_RETRIES = 28  # u32 re-runs allowed after worker deaths: the producer, before the push
R_OWNER = 32  # u32 worker holding this task's fork-join frame: that worker, at its first spawn
R_NEXT = 32  # u64 (K_MSG records only, aliasing R_OWNER/R_INCARNATION): handle + 1 of the next
#              older message of the same mailbox; the sender, before the CAS that pushes it
R_INCARNATION = 36  # u32 that worker's incarnation: same writer/ordering as R_OWNER
R_PCLASS = 40  # u32 call payload storage: 0 inline, i+1 block class i, OVERFLOW
R_RCLASS = 44  # u32 result payload storage, same codes; written before the DONE CAS
R_PREF = 48  # u64 call payload block index / overflow number
R_PLEN = 56  # u64 call payload length
R_RREF = 64  # u64 result payload block index / overflow number
R_RLEN = 72  # u64 result payload length
R_TSUBMIT = 80  # u64 monotonic ns at submit (client) or spawn (worker)
R_TSTART = 88  # u64 monotonic ns when a worker last started it; K_MSG: steps its agent had
#                run when it handled the message (the owner, before D_DONE), for exact replay,
#                with bit 63 (entry.SKIPPED) if its caller cancelled it before it started.
#                Plain stores by the owner; read by a later owner replaying it, ordered by
#                the release store of D_DONE after it and the agent record's re-queue CAS
R_INLINE = 96  # inline area: the call payload at [0, plen), an inline result right after it
RECORD_BYTES = 192
INLINE = 96  # RECORD_BYTES - R_INLINE

# -- the state word -----------------------------------------------------------
GEN_MASK = 0xFFFFFFFF
STATE_SHIFT = 32
STATE_MASK = 0xFF
WHO_SHIFT = 40  # who = worker index + 1 of the worker holding the record (0: nobody / the client)

S_FREE = 0  # on the free ring
S_QUEUED = 1  # published on a queue (injector, a deque); the call payload is intact
S_RUNNING = 2  # claimed by worker who-1: running, or a suspended fork-join frame it holds
S_CANCELLED = 3  # withdrawn by the client while queued; whoever takes it frees it
S_DONE = 4  # result stored; published or being published by worker who-1
S_FREEING = 5  # claimed by who-1 (or the client) for release; payloads being dropped
S_RECOVERING = 6  # claimed by who-1 (or the client) to re-run or fail it (its holder died)

# -- kinds, flags, statuses ------------------------------------------------------
K_ROOT = 1  # submitted by the client; R_LINK is the future id
K_CHILD = 2  # spawned inside a task; R_LINK is the parent's handle
K_MASK = 0xFF
K_MSG = 3  # a message in an agent's mailbox (stealer/agents/mailbox.py); never on a queue
K_REPLY = 4  # the reply slot of a call made by an agent; R_LINK is the calling agent's handle
K_CKPT = 5  # an agent's checkpoint (its pickled state); R_LINK is the mailbox mark it covers
F_AGENT = 0x400  # with K_ROOT: an agent record (its call payload is the spawn; RUNNING|k on its owner)
F_BUFFERS = 0x100  # the call payload is a frame with out-of-band buffers
F_RBUFFERS = 0x200  # the result payload is a frame with out-of-band buffers
F_AWAITED = 0x800  # with K_REPLY: the call came from an agent's generator, which may wait
#                    for it (the callee's call chain, worker/agents/calls.py Calls.waiters)
F_TASKCALL = 0x1000  # with K_CHILD: the reply slot of a call a task made to an agent (QUEUED
#                     on no queue, answered by the agent as a K_REPLY; its DONE pings the task)
OVERFLOW = 0xFFFF  # payload class of an overflow file

ST_OK = 0  # the result is the return value
ST_ERROR = 1  # the result is (exception, traceback text)
ST_LOST = 2  # the worker could not store the result; the inline result is a short reason

# -- MPMC ring claims (W_RING_OP in stealer/shared/shm.py; repaired by stealer/client/ringfix.py) -------
RING_PUSH = 1  # op bits of an intent: a push about to claim an enqueue position
RING_POP = 2  # op bits of an intent: a pop about to claim a dequeue position

# -- park words (stealer/shared/idle.py) ---------------------------------------------------
PARKED = 1
NOTIFIED = 2
PARKED_BATCH = 3  # the client's result thread parked in throughput mode (idle.ResultPolicy)
WAITER_AWAKE = 4  # the waiter word: a client thread holds the waiter role and is awake
# The client park word's neighbours, as byte offsets from it (shm.H_CLIENT_TID/_MOVED; the
# native hand-off reaches them from the park word: HotPath.c_finish's _hand_over)
CLIENT_TID_AT = 4  # u32 the result thread's id while workers may move it (0: they must not)
CLIENT_MOVED_AT = 8  # u32 1: a worker moved it onto its CPU; it takes its CPUs back
WAITER_PARK_AT = 12  # u32 park word of the client thread waiting on a future (_Pool.wait_for)
WAITER_FOR_AT = 16  # u64 the handle of the record that thread waits for (PARKED_BATCH)

# -- agent directory (stealer/agents/mailbox.py): one entry per record slot ---------
DIR_BYTES = 64  # one cache line per agent: senders of different agents never share a line
D_HEAD = 0  # u64 handle + 1 of the newest message (0: none; all ones: closed): senders CAS
D_DONE = 8  # u64 handle + 1 of the newest message the agent has handled: its owner stores
D_CKPT = 16  # u64 handle + 1 of the agent's latest K_CKPT record (0: none): its owner stores
D_COUNT = 24  # u32 messages accepted and not yet handled: senders add, the owner subtracts
D_CAP = 28  # u32 mailbox capacity: the spawner, before the agent record is pushed
D_FLAGS = 32  # u64 AF_* bits: or64/and64 by senders, stoppers and the owner
D_GEN = 40  # u32 agent generation (restarts and stops): its owner stores
D_OWNER = 44  # u32, stats only: bits 0-15 worker index + 1 running the agent now (0: none,
#              OWNER_MOVING: published for another worker), bits 16-31 the agent's migrations
#              (MIGR_SHIFT). Its owner stores it at adoption (adopt.py, +1 migration when it
#              finds OWNER_MOVING there), the publisher stores OWNER_MOVING (leaving.py
#              publish_one), relaxed: the next owner's read is ordered by the record's
#              CAS to QUEUED and push, which its take pairs with; collect() reads it relaxed
OWNER_MASK = 0xFFFF  # D_OWNER's owner bits (MAX_WORKERS is 8,192: worker index + 1 fits)
OWNER_MOVING = 0xFFFF  # D_OWNER's owner bits while the agent is published, between workers
MIGR_SHIFT = 16  # D_OWNER's migration count: moves to a worker other than the publisher,
#                  saturating at 0xFFFF
AF_NOTIFIED = 1  # a notification is on its way to the owner's inbox (cleared by the owner)
AF_STOP = 2  # ref.stop(): finish at the next step boundary
AF_PINGED = 4  # fork-join, any record (not only agents): a ping for this slot's frame is on its
#               way to an inbox (stealer/shared/recovery.py Pings).  Set by the sender's or64 (seq_cst;
#               only the sender that set it pushes), cleared by whoever pops the ping (and64,
#               seq_cst) *before* it looks at the frame's children, and by a recoverer for
#               the frames of a dead worker; the or64 pairs with that and64
AF_CONTROL = 8  # a control-tier agent: set by its spawner before the record is pushed;
#                 senders read it with their notify's or64 and signal a busy owner (inline.py)
D_CPU_NS = 48  # u64 CPU ns the agent's steps and handlers used so far: its owner stores (stats)
D_STEPS = 56  # u32 steps run so far: its owner stores (stats)
D_MSGS = 60  # u32 messages handled so far: its owner stores (stats)
