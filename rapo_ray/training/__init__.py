"""One RL step top to bottom (Trainer), its Ray Data advantage stage, checkpoints and reporting."""
