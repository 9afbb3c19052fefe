"""Where workers come from: a WorkerRegistry yields snapshots of the pool.

- snapshots: the interface (WorkerRegistry) and what it publishes (Snapshot of WorkerSpec)
- static: the list in the YAML (the default)
- etcd: the worker set from etcd, by get + watch (production); keys: its key layout and values
- etcd_client: connecting to etcd (plaintext or TLS)
- lease_keeper: keeping one worker's key registered under a lease (the sidecar and the sim worker use it)
- sidecar: `orchestrator register`, announcing a worker beside it in etcd
"""
