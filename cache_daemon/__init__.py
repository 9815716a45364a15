"""The KVBoost cache daemon: chunk K/V blobs in LMDB under a byte budget, served over gRPC."""
