"""Model building from configs and checkpoints, inputs, images and masks, the memory estimate."""
