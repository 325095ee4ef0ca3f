"""How tensors meet: wire frames, codecs, privacy, group all-reduce, moshpit, gossip."""
