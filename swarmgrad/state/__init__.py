"""A peer's whole training state as others download it: snapshots in parts, sketches that compare
donors, the donor's server, the joiner's download, and kept round results for replays."""
