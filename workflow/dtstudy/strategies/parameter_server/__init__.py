"""Parameter servers (ps_sync, ps_backup, ps_async, ssp): `spec` (torch-free: knobs, checks,
performance model), the workers' side (`strategy`), the messages (`protocol`) and a shard's
process body (`shard`)."""
