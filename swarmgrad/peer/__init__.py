"""What a volunteer runs: Peer, training strategies, state sync, progress, checkpoints."""
