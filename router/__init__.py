"""The prefix-aware router: the inference service's API in front of replicas, each request sent where it is cached."""
