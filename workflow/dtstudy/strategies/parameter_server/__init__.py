"""Parameter servers: the workers' side (`strategy`), the messages (`protocol`) and a shard's
process body (`shard`)."""
