"""Offline model preparation: model directories written before anything serves them (the demo's
random-init models, AWQ checkpoints quantized on a CPU). Nothing here runs inside an engine."""
