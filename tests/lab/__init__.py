"""The lab: separate machines on this one (network namespaces on a private bridge, each with its
own disk, cores, memory limit and link), for what only separate machines show."""
