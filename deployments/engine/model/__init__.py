"""The model side of the engine: weights, the forward pass and its kernels, the KV cache and the step's
device inputs. A lower layer: it knows sequences (what to run) but not the scheduler, the engines or the
grammar (tests/test_architecture.py holds it to that)."""
