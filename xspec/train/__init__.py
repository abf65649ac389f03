"""Training the tiny checkpoints xspec ships (target, MTP and DSpark drafters)."""
