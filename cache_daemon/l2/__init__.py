"""The optional shared second tier under each host's LMDB (Redis or Redis Cluster)."""
