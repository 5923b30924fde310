"""What is built: DeepSpeed sources, the fix applied, wheels, environments, images."""
