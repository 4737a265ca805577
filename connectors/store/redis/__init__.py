"""The Redis backends: a Redis server (``store.py``: :class:`RedisStore`) and a Redis
Cluster (``cluster.py``: :class:`RedisClusterStore`, its slot routing in
``cluster_routing.py``), with what only they use: errors as one-line ``StoreError``s
(``errors.py``), the job lock (``lock.py``), memory settings (``memory.py``) and entries
received straight into the caller's buffer (``receive.py``). The ``redis`` library is
imported only when one of them is opened."""
