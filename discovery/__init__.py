"""Who is in the cluster: zeroconf, hostfiles, capability probes, the authenticated channel."""
