"""KV events in vLLM's format (ZMQ PUB, msgpack), which vllm-router, llm-d and Dynamo route by."""
