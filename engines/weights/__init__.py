"""Model weights sent to agents that lack them: manifests, the coordinator's server, the fetch."""
