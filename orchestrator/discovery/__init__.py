"""Where workers come from: a WorkerRegistry yields snapshots of the pool.

- registry: the interface and WorkerSpec
- static: the list in the YAML (the default)
- etcd: leases + watch (production)
- register: the sidecar that announces a worker in etcd
"""
