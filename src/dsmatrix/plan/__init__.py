"""What runs: the matrix file, the cells a selection plans, the disk they need."""
