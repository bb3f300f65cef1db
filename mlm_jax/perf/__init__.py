"""Speed and size: benchmarks, the costs of compiled programs, and the pre-flight that compiles
for accelerators on a CPU host.

It reads FLOPs per token from model/flops.py and chip figures from runtime/hardware.py;
training imports nothing from here.
"""
