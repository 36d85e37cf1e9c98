"""The agents living on a worker (the host): ``host`` (their turns and scheduling),
``entry`` (one agent's bookkeeping), ``messages`` (delivering messages, replies),
``calls`` (sends and calls an agent makes), ``generators`` (generator steps),
``adopt`` (agents arriving: spawned, stolen, restarted), ``leaving`` (checkpoints,
migration, stop), ``dormant`` (idle agents held cheaply), ``inline`` (control-tier
handlers inside another agent's step), ``runqueue`` (tiers, deadlines, round-robin),
``placement`` (whether a move pays).
"""
