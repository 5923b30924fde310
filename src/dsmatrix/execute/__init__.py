"""What runs the builds: engine tests, DeepSpeed's own tests, benchmarks, one cell, a whole run."""
