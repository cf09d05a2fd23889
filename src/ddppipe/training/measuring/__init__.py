"""What a rank measures of itself and reports out of the training: what its slot cost and where
its time went (efficiency, its memory, its GPU's use, against the compute peak), its data
loader timed alone, and its progress for the hang watchdog (the heartbeat, and how long each
phase may go without one).
"""
