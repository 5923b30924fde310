"""dsmatrix: proves a DeepSpeed ZeRO-3 fix across a compatibility matrix, stock vs patched.

Pipeline, one module per step: matrix -> cells -> environments -> patches/builds -> run ->
results -> verdict -> report. ``cli`` wires them together; ``errors`` holds the one-line
failures every step can raise.
"""

__version__ = "0.1.0"
