"""mop_train: MoE pretraining with bounded per-rank memory peaks, on torchtitan 0.2.2."""

__version__ = "0.1.0"
