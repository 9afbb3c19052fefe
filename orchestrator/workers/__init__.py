"""The workers the orchestrator routes to: who they are, what state each is in, and which one takes a leg.

- roles: the three worker roles
- states: one worker's routing state as a small transition table
- pool: the live worker set (discovery snapshots in, health and load polls, `pick`)
- routing: the policies `pick` uses (round robin, least loaded)
- retry: the one retry rule of both stages (a failed leg moves to another worker of its role)
"""
