"""Training: the DeepSpec drafter recipe, a small target trained from scratch, self-distillation, evaluation.

Torch only (no Ray): the cluster layer adds multi-GPU launching and the CLI.
"""
