"""A team's factory (DESIGN.md §8b): shared services, users and grants, and training slots.

Modules (each imports MLflow / Prefect itself, so `import pfactory.team` stays cheap):
- `errors`    `TeamError` (exit 2); who the MLflow server authenticated and what it grants them
              (`NotAuthenticated`, `PermissionRefused`: exit 77) is `pfactory.tracking.identity`
- `services`  `factory team up|down|status`: a real `mlflow server --app-name basic-auth` and a real
              `prefect server start` with Prefect's auth string on this machine (loopback unless TLS), their
              state (0700, owner-only or a group's), secrets (0600) and `export` lines
- `users`     `factory team user add|role|password`: users and grants through MLflow's auth API (an admin's
              credentials); passwords from a prompt, a file or the environment; refusals in one line
- `slots`     fair training slots: one Prefect global concurrency limit, leases, who holds and who waits
CLI: flows/team.py. Docs: docs/OPERATIONS.md, "A team's factory".
"""
