"""The study's warm pool on this machine: one server process that imports torch, the
strategies and MLflow once, then forks every local run's N + S processes (and every
evaluation) on request, so that a run costs what its training costs, not seconds of start-up.

- One pool per study folder (the working directory, by path and inode) and code version:
  its Unix socket's name is a hash of them, so an edited package, another study or a folder
  made again never reuses a stale pool.
- The first request starts it (`connect`, under a lock); it ends after `IDLE_S` seconds
  without work, or on `python -m dtstudy pool stop` (the Snakefile's onsuccess/onerror).
- A request is served by a forked "job" process; a training job forks one process per
  rank, watches them and the client's connection, and stops every rank as soon as one dies
  or the client goes away (a cancelled submitit job): a lost worker ends its run in seconds.
- Nothing of a run is kept in the server: each job process loads its data and model anew.

`client` (torch- and MLflow-free: the submitit task, the evaluate command) asks the pool;
`server` is the pool (`python -m dtstudy.launch.pool.server`, which the client starts);
`messages` is the wire format between them.
"""
