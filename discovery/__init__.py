"""Who is in the cluster: zeroconf, hostfiles, capability probes, and the authenticated control channel."""
