"""How peers reach each other: frames on the wire, channels over p2pd streams or direct encrypted
TCP, rate caps, who may talk to this peer (admission, bans), and the network runtime that owns
them for one peer. Knows nothing of tensors' meaning: averaging/ and state/ build on it."""
