"""Lookahead Parallelism: sharding of a round over P full replicas, the communicator and the coordinator."""
