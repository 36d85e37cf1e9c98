"""The shared structures: what the client and every worker map in one segment.

``_layout`` (record and directory offsets, the one source native/ is generated from),
``shm`` (the segment: header, per-worker words, rings' places), ``records`` (a record's
state word and its transitions), ``arena`` (records, payloads, the free rings), ``queues``
(the native rings and deques, or ``pyqueues``, their pure-Python twins), ``idle`` (park
words, wakes), ``metrics`` (counters and histograms), ``serialize`` (payload formats),
``recovery`` (settling what a dead process held), ``liveness`` (watching a process),
``failpoints``.  Both sides import these; these import neither side.
"""
