"""Scheduling and the KV cache: which requests run each step and which pages they hold (prefix caching included), and the step's plain-data description the workers run (``step_io``)."""
