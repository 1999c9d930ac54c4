"""Collaborative attention in memory, for any module: the score path, the module swap, the forwards of
families that score inline, and plain torch.nn.MultiheadAttention. Knows no family by name: families (in
architectures/) hand their layout and forward in."""
