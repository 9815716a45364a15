"""gRPC plumbing both servers share (no torch, no lmdb): auth, request guards, binding, ids, checksums, frames."""
