"""Sizes of the Fetch/Store byte stream that the cache contract fixes (cache.proto)."""

# The largest data frame of one chunk's blob on the wire; senders split blobs into frames of this size.
MAX_FRAME_BYTES = 1 << 20
