"""The workers the orchestrator routes to: who they are, what state each is in, and which one takes a leg.

- roles: the three worker roles
- states: one worker's routing state as a small transition table
- pool: the live worker set (discovery snapshots in, health and load polls, `pick` and `route`)
- routing: the policies they use (round robin, least loaded, kv aware)
- instance_watch: has a worker restarted (a new ServerInfo.instance_id)? the pool reads, the KV feed waits
- kv_routing: KV-aware routing's parts (index, event feed, roles), built once from the configuration
- kv_index: which worker holds which prompt prefix; kv_events: the engines' KV events into it;
  prompt_keys: a request's prompt as the index's block keys
- retry: the one retry rule of both stages (a failed leg moves to another worker of its role)
"""
