"""A team's factory (DESIGN.md §8b): shared services, identities, permissions and training slots.

Modules (each imports MLflow / Prefect itself, so `import pfactory.team` stays cheap):
- `errors`    `PermissionRefused` (exit 77, EX_NOPERM), `NotAuthenticated` (exit 77), `TeamError` (exit 2)
- `identity`  who the MLflow server authenticated (`current`, `user_name`), a user's permission on a
              registered model (`permission`): the server's basic-auth app answers, nothing is guessed
- `services`  `factory team up|down|status`: a real `mlflow server --app-name basic-auth` and a real
              `prefect server start` with Prefect's auth string on this machine (loopback unless TLS), their
              state (0700, owner-only or a group's), secrets (0600) and `export` lines
- `users`     `factory team user add|role|password`: users and grants through MLflow's auth API (an admin's
              credentials); passwords from a prompt, a file or the environment; refusals in one line
- `slots`     fair training slots: one Prefect global concurrency limit, leases, who holds and who waits
CLI: flows/team.py. Docs: docs/OPERATIONS.md, "A team's factory".
"""
