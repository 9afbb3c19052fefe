"""What tests need from the orchestrator: the pytest plugin (entry point `orchestrator`), scripted fakes of
the engine client and the pool, and real processes (simulated workers, etcd, orchestrators) on loopback."""
