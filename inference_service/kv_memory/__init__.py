"""K/V memory: the slots' ledger and buffers, their owner, the memory plan, and the tiers (L0, host, placement, rates)."""
