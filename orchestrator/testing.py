"""pytest plugin: fixtures for trio-based tests against real etcd, sim workers and the orchestrator."""
