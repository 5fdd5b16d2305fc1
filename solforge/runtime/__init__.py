"""Runtime: what an optimized model runs on after `optimize` returns.

CUDA-graph replay of launch-bound calls (stepgraphs.py for calls without autograd recording,
traingraphs.py for training calls, graphed.py for a whole step), dynamic shapes (shapes.py: one
graph for many sizes), the optimized model's `generate` (generation.py), and the in-place gradient
accumulation rule the training passes share (accumulate.py), and the `skip_logits` option's
call (logits.py). This package imports nothing at
package level, so its modules can be imported from anywhere without cycles.
"""
