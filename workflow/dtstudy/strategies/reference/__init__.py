"""no_exchange: N workers that exchange nothing, the machine's ceiling. `spec` (torch-free) and
`strategy` (the implementation)."""
