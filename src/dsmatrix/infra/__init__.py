"""Shared infrastructure: errors, locations, processes, progress, the cache, hosts, parallelism, results stores."""
