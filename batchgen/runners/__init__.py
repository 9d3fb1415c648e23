"""Ways to run a job beyond one process: shards and their merge, data-parallel ranks, Ray Data actors."""
