"""stealer on a cluster: one node executor per node of a Ray cluster, stealing between nodes.

``stealer.Executor(cluster=ADDRESS)`` (or ``cluster=True`` when this process already called
``ray.init``) returns a :class:`stealer.cluster.client.ClusterExecutor`.  The package sits on
top of the core, as the joblib integration does: the core imports it only lazily, from the
``Executor`` facade when ``cluster=`` is given (tests/test_layers.py), and ``import stealer``
never imports it nor Ray (the optional extra ``stealer[ray]``).

Modules: ``policy.py`` (placement and the steal rules, pure Python), ``client.py`` (the
executor the user holds: batches, results, node loss), ``ledger.py`` (its records of tasks,
agents and nodes), ``agents.py`` (agents on the cluster), ``balance.py`` (when agents move
between live nodes, pure Python) and ``moves.py`` (moving them), ``node.py`` (the node agent,
a Ray actor on each node that runs that node's local executor), ``snapshot.py`` (the figures
``stealer top`` reads, no Ray), ``journal.py`` (the agents' journal, written by the
client: ``journal=``, ``recover=True``), ``children.py`` (fork-join children
stolen across nodes: exported at spawn by the workers' hook, claimed once, run on a
hungry node, joined at home), ``asks.py`` (a ref sent to a task or an agent: its calls,
sends and stops from the workers, through their node agent and the client; no Ray).
"""
